"""cluster.yaml passes Ray's own cluster-launcher validation and describes spot workers."""

import copy
import pathlib

import yaml

CLUSTER_YAML = pathlib.Path(__file__).resolve().parent.parent / "cluster.yaml"


def test_cluster_yaml_validates_with_rays_validator():
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs before launching


def test_cluster_yaml_has_on_demand_head_and_spot_workers_with_labels():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["labels"]["ray.io/market-type"] == "on-demand"
    spot = {name: t for name, t in types.items() if t.get("labels", {}).get("ray.io/market-type") == "spot"}
    assert len(spot) >= 1
    for t in spot.values():
        assert t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        assert t["max_workers"] > t["min_workers"] >= 0
        assert "rack" in t["labels"]
    assert any("torch==" in cmd for cmd in config["setup_commands"])


def test_validator_rejects_a_broken_config():
    """The check above can fail: a typo'd field is refused by the same validator."""
    import jsonschema
    import pytest
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(CLUSTER_YAML.read_text())
    config["available_node_types"]["spot-gpu-r0"]["max_worker"] = 8  # typo
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))
