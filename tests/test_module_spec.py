"""A user's own nn.Module (embedding, a ModuleList of layers, norm, head) trained as rayflex
blocks through ``ModelSpec.from_module``: same logits and weights as the plain module,
keys that load back into it, training, meta-device setup, and a clear ConfigError for
every module that cannot be cut. One process, no Ray."""

from __future__ import annotations

import functools
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rayflex as rf
from rayflex.errors import ConfigError
from rayflex.models.contract import check_model_contract
from rayflex.models.gpt_blocks import lm_loss
from rayflex.models.module_spec import from_module_state_dict, to_module_key, to_module_state_dict
from rayflex.models.spec import ModelSpec, build_stage

VOCAB, WIDTH, LAYERS, SEQ = 48, 16, 3, 8


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Layer(nn.Module):
    """Causal attention + MLP, pre-norm."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).unsqueeze(1).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Written the usual way, with a whole-module init pass that draws across all layers."""

    def __init__(self, layer=Layer):
        super().__init__()
        self.embed = Embed()
        self.layers = nn.ModuleList(layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def tiny_spec(factory=TinyLM, **options) -> ModelSpec:
    return ModelSpec.from_module(factory, loss_fn=lm_loss, init_seed=7, **options)


def seeded(seed: int = 7) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def whole(spec: ModelSpec):
    return build_stage(spec, list(range(spec.num_blocks)))


def test_blocks_have_the_user_modules_weights_and_logits():
    spec = tiny_spec()
    assert (spec.num_blocks, spec.hidden_size, spec.name) == (LAYERS + 2, WIDTH, "TinyLM-3")
    before = torch.random.get_rng_state()
    model = whole(spec)
    assert torch.equal(torch.random.get_rng_state(), before), "building blocks must not move the caller's RNG"
    user = seeded()
    mine = to_module_state_dict(spec, model.state_dict())
    assert mine.keys() == user.state_dict().keys()
    assert all(torch.equal(mine[k], v) for k, v in user.state_dict().items())
    assert torch.allclose(model(tokens()), user(tokens()), atol=1e-6, rtol=0)
    # Any split builds the same block: a pipeline's second stage holds layers[1:] and the tail.
    tail = build_stage(spec, [2, 3, 4])
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in tail.state_dict().items())


def test_keys_keep_the_user_names_and_load_strictly_into_the_user_module():
    spec = tiny_spec()
    model = whole(spec)
    keys = set(model.state_dict())
    assert {"blocks.0.embed.tok.weight", "blocks.3.qkv.weight", "blocks.4.norm.weight",
            "blocks.4.lm_head.weight"} <= keys
    assert to_module_key(spec, "blocks.3.mlp.0.weight") == "layers.2.mlp.0.weight"
    user = seeded(99)  # other weights, then the rayflex ones loaded into it
    user.load_state_dict(to_module_state_dict(spec, model.state_dict()), strict=True)
    assert torch.equal(model(tokens()), user(tokens()))
    back = from_module_state_dict(spec, user.state_dict())
    assert back.keys() == keys and all(torch.equal(back[k], v) for k, v in model.state_dict().items())


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = Embed()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.register_module("rotary", Rotary())


class Rotary(nn.Module):
    """Buffers only, and never called by the top-level forward: left out with ``ignore``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


class Nested(nn.Module):
    """Hugging Face's shape: the body one level down, the head beside it."""

    def __init__(self):
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def test_dotted_paths_keep_the_nested_names():
    options = dict(blocks="model.layers", pre="model.embed_tokens", post=("model.norm", "lm_head"))
    with pytest.raises(ConfigError, match=r"Nested.model.rotary \(Rotary\) is in none of"):
        tiny_spec(Nested, **options)
    spec = tiny_spec(Nested, ignore="model.rotary", **options)
    model = whole(spec)
    assert {"blocks.0.model.embed_tokens.tok.weight", "blocks.4.model.norm.weight",
            "blocks.4.lm_head.weight"} <= set(model.state_dict())
    assert to_module_key(spec, "blocks.2.qkv.weight") == "model.layers.1.qkv.weight"
    torch.manual_seed(7)
    seeded_sd = Nested().state_dict()
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in from_module_state_dict(spec, seeded_sd).items())
    user = Nested()  # other weights, then the rayflex ones loaded into it
    user.load_state_dict(to_module_state_dict(spec, model.state_dict()), strict=True)
    assert torch.equal(model(tokens()), user(tokens()))


def test_trains_through_the_single_process_reference(tmp_path):
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.testing.reference import single_process_losses

    data = write_synthetic_dataset(f"file://{tmp_path}/tokens", num_samples=256, seq_len=SEQ, vocab_size=VOCAB,
                                   num_shards=1)
    spec = rf.TrainSpec(model=tiny_spec(), data=rf.DataConfig(uri=data, seq_len=SEQ, global_batch=16),
                        run=rf.RunConfig(name="module-spec", storage=f"file://{tmp_path}/runs", steps=30,
                                         optimizer=rf.OptimizerConfig(lr=2e-2)),
                        scaling=rf.ScalingConfig(num_workers=1))
    losses = single_process_losses(spec, 30)
    assert abs(losses[0] - math.log(VOCAB)) < 0.2, losses  # starts at chance, as the user's init does
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.4, losses  # and learns the chain


def test_the_meta_device_setup_builds_identical_weights():
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.meta_init import build_sharded_stages

    spec = tiny_spec()
    reference = whole(spec).state_dict()
    counts = spec.param_counts()
    assert counts == [sum(p.numel() for p in spec.block(i).parameters()) for i in range(spec.num_blocks)]
    assert sum(counts) == sum(p.numel() for p in TinyLM().parameters())
    check_model_contract(spec, batch=2, seq_len=SEQ)  # the good module passes
    for world, pp in ((1, 1), (2, 2)):
        plan = plan_mesh(spec, rf.ParallelConfig(pp=pp), rf.DataConfig(uri="file:///unused", global_batch=8), world)
        got = {}
        for rank in range(world):  # sharding is the identity here: one process, no process group
            for _, stage in build_sharded_stages(spec, plan, rank, torch.device("cpu"), shard=lambda s, m: m):
                got.update(stage.state_dict())
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], v) for k, v in reference.items()), (world, pp)


def test_the_spec_pickles_and_builds_the_same_blocks():
    spec = tiny_spec()
    again = pickle.loads(pickle.dumps(spec))
    assert all(torch.equal(a, b) for a, b in zip(whole(spec).state_dict().values(),
                                                 whole(again).state_dict().values()))


def test_reset_init_is_per_block_deterministic_and_falls_back_to_a_full_build():
    spec = tiny_spec(init="reset")
    first, second = whole(spec).state_dict(), whole(spec).state_dict()
    assert first.keys() == whole(tiny_spec()).state_dict().keys()
    assert all(torch.equal(first[k], second[k]) and torch.isfinite(first[k]).all() for k in first)
    # torch's default init, not the module's: the embedding is N(0, 1), not N(0, 0.02).
    assert first["blocks.0.embed.tok.weight"].std() > 0.5
    assert torch.equal(build_stage(spec, [2]).blocks["2"].qkv.weight, first["blocks.2.qkv.weight"])

    class Scaled(Layer):  # a parameter without reset_parameters: built in full, still seeded
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.randn(WIDTH))

    fallback = tiny_spec(functools.partial(TinyLM, Scaled), init="reset")
    a, b = fallback.block(2).gain, fallback.block(2).gain
    assert torch.equal(a, b) and not torch.equal(a, fallback.block(1).gain)


# --- modules that cannot be cut: a ConfigError when the spec is made -------------------------------------


class NoList(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.body, self.lm_head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)


class WithPositions(TinyLM):
    """A positional table on the root itself: its forward adds it, the blocks never would."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))


class WithDropout(TinyLM):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)


class Tied(TinyLM):
    def __init__(self):
        super().__init__()
        self.lm_head.weight = self.embed.tok.weight


class MaskedLayer(Layer):
    def forward(self, x, mask):
        return super().forward(x) * mask


class PairLayer(Layer):
    def forward(self, x):
        y = super().forward(x)
        return y, x


class NotAModule:
    pass


# case: (options, in the field or problem, in the fix)
CASES = {
    "not a callable": (dict(factory=TinyLM()), "(factory): got a TinyLM, not a zero-argument callable",
                       "functools.partial(MyLM, cfg)"),
    "returns no module": (dict(factory=NotAModule), "factory() returned a NotAModule, not an nn.Module",
                          "return the model"),
    "no list at blocks": (dict(blocks="trunk"), "TinyLM has no submodule 'trunk'", "has these lists: 'layers'"),
    "blocks is not a list": (dict(blocks="norm"), "TinyLM.norm is a LayerNorm, not an nn.ModuleList",
                             "point blocks at the list of layers"),
    "module without a list": (dict(factory=NoList, blocks="body"), "NoList.body is a Linear, not an nn.ModuleList",
                              "NoList has no nn.ModuleList"),
    "missing pre": (dict(pre=("tok_emb", "drop")), "pre names 'tok_emb', but TinyLM has no submodule 'tok_emb'",
                    "pre=('embed',), post=('norm', 'lm_head')"),
    "missing post": (dict(post=("ln_f", "lm_head")), "post names 'ln_f'", "post=('norm', 'lm_head')"),
    "module left out": (dict(post=("lm_head",)), "TinyLM.norm (LayerNorm) is in none of pre=('embed',), "
                        "blocks='layers', post=('lm_head',): it has 32 parameters that would be silently dropped",
                        "add 'norm' to pre or post"),
    "parameter on the root": (dict(factory=WithPositions), "WithPositions.pos is a parameter of WithPositions "
                              "itself", "move it into a submodule"),
    "unlisted dropout": (dict(factory=WithDropout), "WithDropout.drop (Dropout) is in none of",
                         "ignore=('drop',) if forward never calls it"),
    "tied across blocks": (dict(factory=Tied), "Tied.lm_head.weight (block 4, norm -> lm_head) is the same "
                           "parameter as embed.tok.weight (block 0, embed)", "untie them"),
    "forward takes a mask": (dict(factory=functools.partial(TinyLM, MaskedLayer)), "TinyLM.layers[0].forward: "
                             "has signature (x, mask)", "give every argument after the first a default"),
    "overlapping names": (dict(pre=("embed", "embed.tok")), "'embed' overlaps 'embed.tok'", "not both"),
    "pre holds the list": (dict(pre=("embed",), post=("layers",)), "overlaps the layer list 'layers'", "one by one"),
    "unknown init": (dict(init="random"), "unknown init 'random'", "('module', 'reset')"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_module_that_cannot_be_cut_is_a_clear_config_error(case):
    options, problem, fix = CASES[case]
    options = dict(options)
    factory = options.pop("factory", TinyLM)
    with pytest.raises(ConfigError) as err:
        tiny_spec(factory, **options)
    e = err.value
    assert e.field.startswith("ModelSpec.from_module"), str(e)
    assert problem in f"{e.field}: {e.problem}" and fix in e.fix, str(e)


def test_ignored_modules_are_left_out_on_purpose():
    spec = tiny_spec(WithDropout, ignore="drop")
    assert spec.num_blocks == LAYERS + 2 and "drop" not in repr(spec.block(0))


def test_a_layer_returning_a_tuple_is_named_by_the_contract_check():
    spec = tiny_spec(functools.partial(TinyLM, PairLayer))  # its signature is fine; its output is not
    with pytest.raises(ConfigError) as err:
        check_model_contract(spec, batch=2, seq_len=SEQ)
    assert err.value.field == "ModelSpec block 1"
    assert "block 1 returned a tuple of 2 (Tensor[2, 8, 16] float32, Tensor[2, 8, 16] float32), not a single " \
           "tensor" in err.value.problem
    assert "return one tensor from forward()" in err.value.fix


def test_key_mapping_rejects_keys_of_another_model():
    with pytest.raises(ConfigError, match="not made by ModelSpec.from_module"):
        to_module_state_dict(rf.models.gpt(vocab_size=VOCAB, seq_len=SEQ, d_model=WIDTH, n_layers=1, n_heads=2), {})
    with pytest.raises(ConfigError, match="not a key of this spec"):
        to_module_key(tiny_spec(), "blocks.9.qkv.weight")
