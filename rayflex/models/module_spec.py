"""A user's own ``nn.Module`` as a ModelSpec, without rewriting it as blocks.

Many models are ``pre -> nn.ModuleList -> post``: an embedding, a list of layers, a norm
and a head, with a ``forward`` that applies them in that order. ``ModelSpec.from_module``
cuts such a module into rayflex blocks: block 0 is the ``pre`` modules chained, then one
block per entry of the list, then the ``post`` modules chained (an empty ``pre`` or
``post`` has no block). Only that chain is reproduced: whatever the module's own
``forward`` does between them (adding positions, scaling, building a mask) rayflex never
sees, so it must live inside one of the modules.

The structure is read from one build on the meta device when the spec is made (shapes
only, milliseconds), so a module that cannot be cut is a ConfigError before any work
starts: no list at ``blocks``, ``pre``/``post`` names that do not exist, a parameter,
buffer or module outside pre, blocks and post (its weights would be silently dropped), a
parameter tied across two blocks (each block trains its own), a ``forward`` that needs
more than one argument. A layer that returns a tuple shows only when it runs: the
contract check (:mod:`rayflex.models.contract`) runs every block on meta before any actor
starts and names the block.

Names stay the user's: block 0 holds ``embed`` as ``blocks.0.embed.weight``, block 3 *is*
``layers[2]`` (``blocks.3.attn.w``), so :func:`to_module_state_dict` maps trained weights
back to keys the user's module loads with ``load_state_dict(strict=True)``.

Weights (``init="module"``, the default): block ``i``'s tensors are exactly those of
``torch.manual_seed(init_seed); factory()`` built on the CPU, whatever the split or the
device, so a run starts from the user's own initialisation and can be checked against the
plain module. The cost: a user's init may draw its random numbers in any order across the
whole module (``self.apply(self._init_weights)`` does), so only a full init reproduces one
block's values. Every real build of a block therefore builds the whole module on the CPU
and keeps its piece: building all ``N`` blocks costs ``N`` full builds (O(N^2) layer
inits) and peaks at one whole model in host memory, block by block (meta-device worker
setup, :mod:`rayflex.worker.meta_init`, builds each of a rank's blocks this way once).
Meta builds (the contract check, parameter counts, meta setup) cost a meta build each.
The seed is the CPU generator's (``torch.manual_seed`` is what sets it), fixed when the
spec is made: ``dataclasses.replace(spec, init_seed=...)`` does not reach it; make a new
spec with ``from_module(..., init_seed=...)`` instead.

``init="reset"`` is the cheap alternative: block ``i`` is built on meta, moved to the
device empty, and every submodule's ``reset_parameters()`` runs under the block's own
seed (:meth:`ModelSpec.block`): O(block) per block, deterministic for any split, but it is
torch's default init of each layer, *not* the module's own (an ``nn.init.normal_(std=0.02)``
in the user's ``__init__`` is lost) and values depend on the device's generator. A block
holding a module with parameters but no ``reset_parameters``, or buffers other than a
norm's running stats, is built in full instead (``factory()`` on the device under the
block's seed, keeping the piece).
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rayflex.errors import ConfigError
from rayflex.models.contract import describe
from rayflex.models.meta import SkipMetaInit, on_meta

WHERE = "ModelSpec.from_module"
INITS = ("module", "reset")
LISTS = (nn.ModuleList, nn.Sequential)
# Path segments that wrappers insert (checkpoint_wrapper, torch.compile); not the user's.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


@dataclass(frozen=True)
class ModuleLayout:
    """Where each block of a ``from_module`` spec lives in the user's module (names only,
    so the spec pickles small)."""

    pre: tuple[str, ...]
    blocks: str
    num_layers: int
    post: tuple[str, ...]

    @property
    def first_layer(self) -> int:
        return 1 if self.pre else 0

    @property
    def num_blocks(self) -> int:
        return self.first_layer + self.num_layers + (1 if self.post else 0)

    def layer_of(self, index: int) -> int | None:
        """The list entry block ``index`` is, or None for a chained pre/post block."""
        j = index - self.first_layer
        return j if 0 <= j < self.num_layers else None

    def chain_of(self, index: int) -> tuple[str, ...]:
        if self.pre and index == 0:
            return self.pre
        if self.post and index == self.num_blocks - 1:
            return self.post
        raise IndexError(f"block {index} of {self.num_blocks} is not a pre/post block")

    def source(self, index: int) -> str:
        """Block ``index`` in the user's words: ``layers[2]`` or ``norm -> lm_head``."""
        j = self.layer_of(index)
        return f"{self.blocks}[{j}]" if j is not None else " -> ".join(self.chain_of(index))

    def module_key(self, key: str) -> str:
        """``blocks.3.attn.w`` -> ``layers.2.attn.w``; ``blocks.0.embed.weight`` -> ``embed.weight``."""
        parts = [p for p in key.split(".") if p not in _WRAPPER_SEGMENTS]
        if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit() \
                or not 0 <= int(parts[1]) < self.num_blocks:
            raise ConfigError("to_module_key", f"{key!r} is not a key of this spec's blocks "
                              f"(blocks.<0..{self.num_blocks - 1}>.<name>)", "pass keys of a rayflex "
                              "state dict of this spec, e.g. Stage.state_dict() or a checkpoint's model entries")
        index, rest = int(parts[1]), ".".join(parts[2:])
        j = self.layer_of(index)
        if j is not None:
            return f"{self.blocks}.{j}.{rest}"
        if not any(rest.startswith(p + ".") for p in self.chain_of(index)):
            raise ConfigError("to_module_key", f"{key!r}: block {index} holds only {self.source(index)}",
                              "pass keys of a rayflex state dict of this spec")
        return rest

    def rayflex_key(self, key: str) -> str:
        """The inverse of :meth:`module_key`: ``layers.2.attn.w`` -> ``blocks.3.attn.w``."""
        head = self.blocks + "."
        if key.startswith(head):
            j, _, rest = key[len(head):].partition(".")
            if j.isdigit() and int(j) < self.num_layers and rest:
                return f"blocks.{self.first_layer + int(j)}.{rest}"
        for index in ([0] if self.pre else []) + ([self.num_blocks - 1] if self.post else []):
            if any(key.startswith(p + ".") for p in self.chain_of(index)):
                return f"blocks.{index}.{key}"
        raise ConfigError("to_rayflex_key", f"{key!r} is in none of pre={self.pre}, blocks={self.blocks!r}, "
                          f"post={self.post}", "pass keys of the module this spec was made from")


class Chain(nn.Module):
    """The pre (or post) modules, applied one after another, each kept at its own path
    (``model.embed_tokens`` stays ``model.embed_tokens``) so state-dict keys stay the user's."""

    def __init__(self, named: Iterable[tuple[str, nn.Module]]):
        super().__init__()
        named = list(named)
        for path, module in named:
            parent = self
            *outer, leaf = path.split(".")
            for seg in outer:
                if seg not in parent._modules:
                    parent.add_module(seg, nn.Module())
                parent = parent._modules[seg]
            parent.add_module(leaf, module)
        self._chain_paths = tuple(path for path, _ in named)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path in self._chain_paths:
            x = self.get_submodule(path)(x)
        return x

    def extra_repr(self) -> str:
        return " -> ".join(self._chain_paths)


class ModuleBlocks:
    """``build_block`` of a ``from_module`` spec: block ``index`` cut out of ``factory()``.

    Called by :meth:`ModelSpec.block` under the block's seed and inside
    ``torch.device(device)``; the device is read back with ``torch.get_default_device()``.
    """

    def __init__(self, factory: Callable[[], nn.Module], layout: ModuleLayout, *, init: str, init_seed: int):
        self.factory, self.layout, self.init, self.init_seed = factory, layout, init, init_seed

    def __repr__(self) -> str:
        return f"ModuleBlocks({getattr(self.factory, '__name__', self.factory)!r}, {self.layout}, init={self.init!r})"

    def __call__(self, index: int) -> nn.Module:
        if not 0 <= index < self.layout.num_blocks:
            raise IndexError(f"block {index} of a {self.layout.num_blocks}-block spec")
        device = torch.get_default_device()
        if device.type == "meta":  # shapes only: init has nothing to write
            with SkipMetaInit():
                return self.cut(self.factory(), index)
        if self.init == "module":
            # The CPU generator only, reseeded and restored: what `torch.manual_seed(s); factory()`
            # draws on the CPU, and neither the caller's CPU nor its CUDA state changes.
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                torch.default_generator.manual_seed(self.init_seed)
                full = self.factory()
            return self.cut(full, index).to(device)
        return self._reset_build(index, device)

    def cut(self, root: nn.Module, index: int) -> nn.Module:
        """Block ``index`` of ``root``: the list entry itself, or a Chain of the pre/post modules."""
        j = self.layout.layer_of(index)
        if j is not None:
            return root.get_submodule(self.layout.blocks)[j]
        return Chain((p, root.get_submodule(p)) for p in self.layout.chain_of(index))

    def _reset_build(self, index: int, device: torch.device) -> nn.Module:
        with on_meta():
            piece = self.cut(self.factory(), index)
        if not _resettable(piece):
            return self.cut(self.factory(), index)  # in full, on `device`, under the block's seed
        piece.to_empty(device=device)
        with torch.no_grad():
            for module in reversed(list(piece.modules())):  # children first: a parent's own init wins
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
        return piece


def _resettable(piece: nn.Module) -> bool:
    """Whether ``reset_parameters()`` gives every tensor of ``piece`` a value after ``to_empty``."""
    for m in piece.modules():
        params = next(m.parameters(recurse=False), None) is not None
        buffers = next(m.buffers(recurse=False), None) is not None
        if (params or buffers) and not callable(getattr(m, "reset_parameters", None)):
            return False
        if buffers and not isinstance(m, nn.modules.batchnorm._NormBase):  # running stats: reset
            return False
    return True


def module_spec_fields(factory: Callable[[], nn.Module], blocks: str = "layers", *,
                       pre: str | Iterable[str] = ("embed",), post: str | Iterable[str] = ("norm", "lm_head"),
                       loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str | None = None,
                       hidden_size: int = 0, init_seed: int = 1234, init: str = "module",
                       ignore: str | Iterable[str] = (), tp_plan: dict[str, str] | None = None,
                       tp_divides: dict[str, int] | None = None) -> dict[str, Any]:
    """The fields of the ModelSpec that ``ModelSpec.from_module`` returns (see there)."""
    if not callable(factory) or isinstance(factory, nn.Module):
        raise ConfigError(f"{WHERE}(factory)", f"got {describe(factory)}, not a zero-argument callable",
                          "pass the module's class or a function that builds it, e.g. functools.partial(MyLM, "
                          "cfg): rayflex builds it on the meta device to read its structure and again per block")
    if init not in INITS:
        raise ConfigError(f"{WHERE}(init)", f"unknown init {init!r}", f"use one of {INITS}")
    if not isinstance(blocks, str) or not blocks:
        raise ConfigError(f"{WHERE}(blocks)", f"got {blocks!r}", "pass the attribute path of the nn.ModuleList "
                          "of layers as a string, e.g. blocks='layers' or blocks='model.layers'")
    pre, post, ignore = _names(pre, "pre"), _names(post, "post"), _names(ignore, "ignore")
    root = _meta_build(factory)
    layers = _find_layers(root, blocks)
    _check_paths(blocks, pre, post, ignore)
    for role, paths in (("pre", pre), ("post", post), ("ignore", ignore)):
        for p in paths:
            _resolve(root, p, role, blocks)
    layout = ModuleLayout(pre=pre, blocks=blocks, num_layers=len(layers), post=post)
    builder = ModuleBlocks(factory, layout, init=init, init_seed=init_seed)
    pieces = [builder.cut(root, i) for i in range(layout.num_blocks)]
    _check_coverage(root, layout, pieces, ignore, layers)
    _check_ties(root, layout, pieces)
    _check_forwards(root, layout, pieces)
    if not hidden_size:  # the width the embedding hands to the layers, when it says so
        embeds = [m for p in pre for m in root.get_submodule(p).modules() if isinstance(m, nn.Embedding)]
        hidden_size = embeds[-1].embedding_dim if embeds else 0
    tp = _tp_metadata(root, layout, tp_plan, tp_divides)
    return {"name": name or f"{type(root).__name__}-{len(layers)}", "num_blocks": layout.num_blocks,
            "build_block": builder, "loss_fn": loss_fn, "hidden_size": hidden_size, "init_seed": init_seed,
            "metadata": {"tp": tp}}


def _tp_metadata(root: nn.Module, layout: ModuleLayout, plan: dict[str, str] | None,
                 divides: dict[str, int] | None) -> dict:
    """``metadata["tp"]`` from a plan in transformers' notation: paths in *your* module,
    ``*`` for the layer index (``{"layers.*.attn.q": "colwise", "embed": "rowwise_replicated_input",
    "lm_head": "colwise_gather_output"}``). Every path must name a module: a typo would
    otherwise leave that module whole and the model silently wrong on tp ranks."""
    from rayflex.models.tp_plan import STYLES, tp_metadata

    if plan is None:
        return {"unsupported": "ModelSpec.from_module was given no tp_plan"}
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(f"{WHERE}(tp_plan)", f"got {plan!r}", "pass a dict of module path -> style, e.g. "
                          "{'layers.*.attn.q_proj': 'colwise', 'layers.*.attn.o_proj': 'rowwise'}")
    parts: dict[str, dict[str, str]] = {"first": {}, "inner": {}, "last": {}}
    layer_prefix = layout.blocks + ".*."
    for path, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"{WHERE}(tp_plan)", f"{path!r}: unknown style {style!r}", f"use one of {STYLES}")
        if path.startswith(layer_prefix):
            inner = path[len(layer_prefix):]
            target, where = root.get_submodule(layout.blocks)[0], "inner"
        else:
            owner = next((p for p in layout.pre + layout.post if path == p or path.startswith(p + ".")), None)
            if owner is None:
                raise ConfigError(f"{WHERE}(tp_plan)", f"{path!r} is in neither the layers ({layer_prefix}...) "
                                  f"nor pre/post {layout.pre + layout.post}",
                                  f"write layer paths as {layer_prefix}<path>, others by their own path")
            inner, target = path, root
            where = "first" if owner in layout.pre else "last"
        try:
            target.get_submodule(inner)
        except AttributeError:
            raise ConfigError(f"{WHERE}(tp_plan)", f"{path!r} names no module of the model",
                              "check the path against model.named_modules()") from None
        parts[where][inner] = style
    # Without pre (post) modules the first (last) block is a layer: it splits as one.
    for where, modules in (("first", layout.pre), ("last", layout.post)):
        if not modules:
            parts[where] = dict(parts["inner"])
    return tp_metadata(**parts, divides=dict(divides or {}))


def _names(value, role: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{WHERE}({role})", f"got {value!r}", f"pass attribute names in forward order, "
                          f"e.g. {role}=('embed',) or {role}='embed' (dotted paths like 'model.norm' work)")
    return names


def _meta_build(factory) -> nn.Module:
    try:
        with on_meta():
            root = factory()
    except Exception as err:  # noqa: BLE001 - the user's code: say where it failed
        text = str(err).strip().splitlines()
        raise ConfigError(f"{WHERE}(factory)", f"factory() on the meta device raised {type(err).__name__}: "
                          f"{text[0] if text else ''}", "make factory a zero-argument callable that builds the "
                          "module on the default device (rayflex builds it on 'meta' to read its structure); "
                          "bind arguments with functools.partial(MyLM, cfg)") from err
    if not isinstance(root, nn.Module):
        raise ConfigError(f"{WHERE}(factory)", f"factory() returned {describe(root)}, not an nn.Module",
                          "return the model (an nn.Module) from factory")
    return root


def _check_paths(blocks: str, pre: tuple[str, ...], post: tuple[str, ...], ignore: tuple[str, ...]) -> None:
    roles = [("pre", p) for p in pre] + [("post", p) for p in post] + [("ignore", p) for p in ignore]
    twice = [p for p, n in Counter(p for _, p in roles).items() if n > 1]
    if twice:
        raise ConfigError(f"{WHERE}(pre/post/ignore)", f"{twice[0]!r} is listed more than once",
                          "name each module once: in pre (before the layers), post (after) or ignore")
    for role, p in roles:
        if p == blocks or blocks.startswith(p + ".") or p.startswith(blocks + "."):
            raise ConfigError(f"{WHERE}({role})", f"{p!r} overlaps the layer list {blocks!r}: a module can be in "
                              "one block only", "name the modules around the layer list one by one, e.g. "
                              "pre=('model.embed_tokens',) rather than pre=('model',)")
        inner = next((q for _, q in roles if q.startswith(p + ".")), None)
        if inner is not None:
            raise ConfigError(f"{WHERE}({role})", f"{p!r} overlaps {inner!r}, which is inside it: a module can be "
                              "in one block only", f"name either {p!r} or the modules inside it, not both")


def _find_layers(root: nn.Module, blocks: str) -> nn.Module:
    lists = [n for n, m in root.named_modules() if n and isinstance(m, LISTS)]
    lists = [n for n in lists if not any(n.startswith(o + ".") for o in lists)]  # not the lists inside layers
    hint = (f"{type(root).__name__} has these lists: {', '.join(repr(n) for n in lists[:6])}" if lists else
            f"{type(root).__name__} has no nn.ModuleList; from_module needs the layers in one (write a ModelSpec "
            "with your own build_block for other structures)")
    try:
        layers = root.get_submodule(blocks)
    except AttributeError:
        raise ConfigError(f"{WHERE}(blocks)", f"{type(root).__name__} has no submodule {blocks!r}",
                          f"pass blocks='<path of the layer list>'; {hint}") from None
    if not isinstance(layers, LISTS):
        raise ConfigError(f"{WHERE}(blocks)", f"{type(root).__name__}.{blocks} is {describe(layers)}, not an "
                          "nn.ModuleList", f"point blocks at the list of layers; {hint}")
    if len(layers) == 0:
        raise ConfigError(f"{WHERE}(blocks)", f"{type(root).__name__}.{blocks} is empty",
                          "build the module with at least one layer")
    return layers


def _resolve(root: nn.Module, path: str, role: str, blocks: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError:
        pass
    before, after = suggest(root, blocks)
    owner, _, leaf = path.rpartition(".")
    try:
        children = list(root.get_submodule(owner)._modules)
        where = f"{type(root).__name__}.{owner}" if owner else type(root).__name__
        has = f"{where} has no submodule {leaf!r} (its children: {', '.join(children)})"
    except AttributeError:
        has = f"{type(root).__name__} has no submodule {owner!r}"
    raise ConfigError(f"{WHERE}({role})", f"{role} names {path!r}, but {has}",
                      f"pass the modules forward applies before the layers as pre=(...) and after them as "
                      f"post=(...), in that order; by registration order that would be pre={before!r}, "
                      f"post={after!r}")


def suggest(root: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A guess at (pre, post) for the error messages: the modules registered before and after
    the layer list (and its containers), in registration order."""
    levels, node, prefix = [], root, ""
    for seg in blocks.split("."):
        names = [n for n, m in node._modules.items() if m is not None]
        if seg not in names:
            break
        k = names.index(seg)
        levels.append(([prefix + n for n in names[:k]], [prefix + n for n in names[k + 1:]]))
        node, prefix = node._modules[seg], f"{prefix}{seg}."
    return (tuple(n for before, _ in levels for n in before),
            tuple(n for _, after in reversed(levels) for n in after))


def _check_coverage(root: nn.Module, layout: ModuleLayout, pieces: list[nn.Module], ignore: tuple[str, ...],
                    layers: nn.Module) -> None:
    """Every parameter, buffer and module of ``root`` is in some block (or ignored on purpose)."""
    kept = {id(m) for piece in pieces for m in piece.modules()} | {id(layers)}
    kept |= {id(m) for p in ignore for m in root.get_submodule(p).modules()}
    ancestors = {""}
    for path in (*layout.pre, layout.blocks, *layout.post, *ignore):
        segs = path.split(".")
        ancestors |= {".".join(segs[:k]) for k in range(1, len(segs))}
    cls = type(root).__name__
    before, after = suggest(root, layout.blocks)
    for a in sorted(ancestors, key=lambda p: (p.count("."), p)):
        owner = root.get_submodule(a) if a else root
        owner_name = f"{cls}.{a}" if a else cls
        for kind, table in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for n, t in table.items():
                if t is not None:
                    raise ConfigError(f"{WHERE}", f"{owner_name}.{n} is a {kind} of {owner_name} itself, outside "
                                      "pre, blocks and post, so rayflex's blocks would silently drop it",
                                      "move it into a submodule listed in pre or post (e.g. a positional "
                                      "embedding into the embedding module)")
        for n, child in owner._modules.items():
            path = f"{a}.{n}" if a else n
            if child is None or path in ancestors or id(child) in kept:
                continue
            count = sum(t.numel() for t in child.parameters())
            what = (f"{count:,} parameters that would be silently dropped" if count else
                    "no parameters, but rayflex's blocks would not apply it where forward does")
            raise ConfigError(f"{WHERE}", f"{cls}.{path} ({type(child).__name__}) is in none of pre={layout.pre}, "
                              f"blocks={layout.blocks!r}, post={layout.post}: it has {what}",
                              f"add {path!r} to pre or post at the place forward applies it (by registration "
                              f"order: pre={before!r}, post={after!r}), or to ignore=({path!r},) if forward "
                              "never calls it")


def _check_ties(root: nn.Module, layout: ModuleLayout, pieces: list[nn.Module]) -> None:
    owner: dict[int, tuple[int, str]] = {}
    for i, piece in enumerate(pieces):
        for n, p in piece.named_parameters(remove_duplicate=False):
            key = layout.module_key(f"blocks.{i}.{n}")
            first = owner.setdefault(id(p), (i, key))
            if first[0] != i:
                raise ConfigError(f"{WHERE}", f"{type(root).__name__}.{key} (block {i}, {layout.source(i)}) is "
                                  f"the same parameter as {first[1]} (block {first[0]}, {layout.source(first[0])}): "
                                  "tied weights across blocks would be trained as two separate tensors",
                                  f"untie them in factory (give {key.rpartition('.')[0] or key} its own "
                                  "parameter), or keep both modules in the same pre or post block")


def _check_forwards(root: nn.Module, layout: ModuleLayout, pieces: list[nn.Module]) -> None:
    """Each module rayflex calls gets one tensor: reject a forward that needs more."""
    seen = set()
    for i, piece in enumerate(pieces):
        called = ([(f"{layout.blocks}[{layout.layer_of(i)}]", piece)] if layout.layer_of(i) is not None else
                  [(p, piece.get_submodule(p)) for p in layout.chain_of(i)])
        for path, module in called:
            fn = getattr(type(module), "forward", None)
            if fn in seen:
                continue
            seen.add(fn)
            problem = _forward_problem(module)
            if problem:
                raise ConfigError(f"{WHERE}: {type(root).__name__}.{path}.forward", f"{problem}, but rayflex calls "
                                  f"block {i} ({layout.source(i)}) with one tensor, the previous block's output",
                                  "give every argument after the first a default, or compute it inside the module "
                                  "(a causal mask from x.shape, positions from torch.arange(x.shape[1]))")


def _forward_problem(module: nn.Module) -> str:
    if type(module).forward is nn.Module.forward:
        return f"is not defined ({type(module).__name__} has no forward of its own)"
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin without a signature: the contract check will tell
        return ""
    params = list(sig.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.default is p.empty and
                p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY)]
    takes_one = any(p.kind in (*positional, inspect.Parameter.VAR_POSITIONAL) for p in params)
    if len(required) > 1 or not takes_one or (required and sig.parameters[required[0]].kind not in positional):
        return f"has signature {sig} (required: {', '.join(required) or 'no positional argument'})"
    return ""


def layout_of(spec) -> ModuleLayout:
    """The layout of a spec made by ``ModelSpec.from_module`` (a ModelSummary of one too)."""
    if hasattr(spec, "payload") and hasattr(spec, "load"):
        spec = spec.load()
    builder = getattr(spec, "build_block", None)
    if not isinstance(builder, ModuleBlocks):
        raise ConfigError("to_module_state_dict(spec)", f"{getattr(spec, 'name', spec)!r} was not made by "
                          "ModelSpec.from_module, so its keys are not a module's", "pass the spec that "
                          "ModelSpec.from_module returned")
    return builder.layout


def to_module_key(spec, key: str) -> str:
    """A rayflex key of ``spec`` as the user's module names it (``blocks.3.attn.w`` -> ``layers.2.attn.w``)."""
    return layout_of(spec).module_key(key)


def to_module_state_dict(spec, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A rayflex state dict of ``spec`` (every block, e.g. ``build_stage(...).state_dict()``)
    keyed as the user's module: ``module.load_state_dict(to_module_state_dict(spec, sd))``."""
    layout = layout_of(spec)
    return {layout.module_key(k): v for k, v in state_dict.items()}


def from_module_state_dict(spec, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse: the user's module's state dict keyed as ``spec``'s blocks (to load the
    weights of a plain module into a rayflex ``Stage``)."""
    layout = layout_of(spec)
    return {layout.rayflex_key(k): v for k, v in state_dict.items()}
