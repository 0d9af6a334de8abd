"""deploy/kuberay/*.yaml are valid KubeRay objects with a labelled spot worker group.

The schemas are KubeRay's own CRD openAPIV3Schema (ray.io/v1), vendored under
tests/data/kuberay/ with the source commit in their header. The API server checks a
custom resource against that schema, and `kubectl apply` (field validation Strict, the
default since Kubernetes 1.27) also refuses fields the schema does not name, except below
`x-kubernetes-preserve-unknown-fields`; :func:`_strict` adds that rule to the schema.
"""

import copy
import dataclasses
import pathlib
import re
import shlex
import typing

import jsonschema
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kuberay"
SCHEMAS = pathlib.Path(__file__).resolve().parent / "data" / "kuberay"
GKE_SPOT = "cloud.google.com/gke-spot"


def _load(path: pathlib.Path):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the vendored schemas are ~0.5 MB
    with open(path) as f:
        return yaml.load(f, Loader=loader)


def _strict(schema):
    """Refuse undeclared fields, as `kubectl apply --validate=strict` does."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "properties" else _strict(v)) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validators():
    out = {}
    for kind, name in (("RayCluster", "rayclusters"), ("RayJob", "rayjobs")):
        schema = _strict(_load(SCHEMAS / f"{name}.v1.schema.yaml"))
        jsonschema.Draft7Validator.check_schema(schema)
        out[kind] = jsonschema.Draft7Validator(schema)
    return out


@pytest.fixture(scope="module")
def manifests():
    return {"RayCluster": _load(DEPLOY / "raycluster.yaml"), "RayJob": _load(DEPLOY / "rayjob.yaml")}


def _cluster_spec(manifest):
    return manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]


def _errors(validator, manifest):
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest))


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_manifest_validates_against_the_kuberay_crd_schema(kind, validators, manifests):
    manifest = manifests[kind]
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", kind)
    assert _errors(validators[kind], manifest) == []


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_on_demand_head_and_a_labelled_spot_gpu_worker_group(kind, manifests):
    from ray._private.label_utils import parse_node_labels_string

    spec = _cluster_spec(manifests[kind])
    assert spec["rayVersion"] == "2.60.0" and spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["labels"]["ray.io/market-type"] == "on-demand"
    assert GKE_SPOT not in head["template"]["spec"].get("nodeSelector", {})
    groups = spec["workerGroupSpecs"]
    spot = [g for g in groups if g["labels"].get("ray.io/market-type") == "spot"]
    assert spot, "no worker group is labelled ray.io/market-type: spot"
    for group in [head, *groups]:
        # KubeRay's operator refuses rayStartParams["labels"] (utils/validation.go); the
        # labels field reaches Ray as `ray start --labels k=v,...`, which Ray parses so:
        assert "labels" not in group["rayStartParams"]
        line = ",".join(f"{k}={v}" for k, v in group["labels"].items())
        assert parse_node_labels_string(line) == group["labels"]
    for group in spot:
        pod = group["template"]["spec"]
        assert pod["nodeSelector"][GKE_SPOT] == "true"
        assert {"key": GKE_SPOT, "operator": "Equal", "value": "true", "effect": "NoSchedule"} in pod["tolerations"]
        assert "rack" in group["labels"]
        zone = pod["nodeSelector"]["topology.kubernetes.io/zone"]
        assert group["labels"]["ray.io/availability-zone"] == zone  # the label says where the pod is
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
        assert container["resources"]["requests"] == container["resources"]["limits"]


def test_images_are_pinned_and_built_with_a_pinned_torch(manifests):
    images = set()
    for manifest in manifests.values():
        spec = _cluster_spec(manifest)
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            images |= {c["image"] for c in group["template"]["spec"]["containers"]}
    assert len(images) == 1, images  # head and workers on one build
    (image,) = images
    tag = image.rsplit(":", 1)[1]
    assert "/" not in tag and tag != "latest" and "torch2.13.0" in tag and "ray2.60.0" in tag
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM rayproject/ray:2\.60\.0-", dockerfile, re.M)
    assert '"torch==2.13.0"' in dockerfile and image in dockerfile


def test_rayjob_runs_rayflex_with_valid_overrides(manifests):
    from rayflex.config import TrainSpec, apply_override

    spec = manifests["RayJob"]["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["rayflex", "run", "examples/gpt_small.py"]
    assert (ROOT / argv[2]).is_file()
    assert spec["backoffLimit"] == 0 and spec["shutdownAfterJobFinishes"] is True
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets
    sections = typing.get_type_hints(TrainSpec)
    for item in sets:  # every override names a real field and a valid value
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        cfg = apply_override(sections[section](), name, raw)
        dataclasses.replace(cfg)  # re-validates
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert set(env) == {"RAYFLEX_DEMO_STORAGE", "RAYFLEX_DEMO_DATA"}


def _set(doc, path, value):
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _rename(doc, path, new_name):
    for key in path[:-1]:
        doc = doc[key]
    doc[new_name] = doc.pop(path[-1])


WORKER = ["spec", "workerGroupSpecs", 0]
POD = [*WORKER, "template", "spec"]


@pytest.mark.parametrize("break_it, expected", [
    # a wrong type: replicas is an int32
    (lambda m: _set(m, [*WORKER, "replicas"], "two"), "'two' is not of type 'integer'"),
    # the classic YAML slip: an unquoted true is a boolean, nodeSelector values are strings
    (lambda m: _set(m, [*POD, "nodeSelector", GKE_SPOT], True), "True is not of type 'string'"),
    # an enum: authOptions.mode is disabled or token
    (lambda m: _set(m, ["spec", "authOptions", "mode"], "tokens"), "'tokens' is not one of"),
    # a typo'd field in a checked object (kubectl's strict field validation)
    (lambda m: _rename(m, [*WORKER, "maxReplicas"], "maxReplica"), "'maxReplica' was unexpected"),
    (lambda m: _rename(m, [*POD, "tolerations"], "toleration"), "'toleration' was unexpected"),
    # a required field: groupName
    (lambda m: m["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required property"),
])
def test_schema_rejects_a_broken_raycluster(break_it, expected, validators, manifests):
    manifest = copy.deepcopy(manifests["RayCluster"])
    break_it(manifest)
    errors = _errors(validators["RayCluster"], manifest)
    assert any(expected in e for e in errors), errors


def test_schema_rejects_a_broken_rayjob(validators, manifests):
    manifest = copy.deepcopy(manifests["RayJob"])
    manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplicas"] = "0"
    manifest["spec"]["shutdownAfterJobFinished"] = True  # typo of shutdownAfterJobFinishes
    errors = _errors(validators["RayJob"], manifest)
    assert any("rayClusterSpec.workerGroupSpecs.0.minReplicas" in e and "'0' is not of type 'integer'" in e
               for e in errors), errors
    assert any("'shutdownAfterJobFinished' was unexpected" in e for e in errors), errors


def test_fields_under_preserve_unknown_fields_stay_open():
    """The strict rule stops where the CRD says unknown fields are kept (not a blanket ban)."""
    schema = {"type": "object", "properties": {
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "properties": {"a": {"type": "string"}}},
        "closed": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    validator = jsonschema.Draft7Validator(_strict(schema))
    assert validator.is_valid({"open": {"a": "x", "b": 1}})
    assert not validator.is_valid({"closed": {"a": "x", "b": 1}})
    assert not validator.is_valid({"other": 1})
