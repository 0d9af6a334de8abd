"""Repeat saves of one attempt pay for their bytes, not for DCP's bookkeeping.

An asynchronous save runs beside training: every CPU-millisecond it spends is taken from
the step. DCP's protocol, per save, for every entry of the state dict: flatten the nested
state dict, list this rank's write items, gather every rank's plan to rank 0 and scatter
it back, write, gather every rank's write results (a pickled ``WriteResult`` per entry) to
rank 0, pickle ``.metadata`` from them, and broadcast that metadata back to every rank. For
a small GPT this was most of a save's CPU, and none of it changes between two saves of
one attempt: the same staged tensors under the same keys, the same plans, the same places
in the same files. :class:`SavePlanCache` (one per checkpointer, i.e. per attempt) keeps:

* DCP's plan caching (``enable_plan_caching``), keyed per checkpointer, and this rank's
  own local plan, reused while the state dict holds the very same tensors;
* the state dict flattened the cheap way when it is what rayflex saves (dicts of leaves);
* every rank's write results packed into one ``bytes`` object (:class:`PackedWriteResults`:
  the gather pickles and unpickles one object per rank, not one per entry), and on rank 0
  the pickled ``.metadata`` of the last save, written again unchanged while every rank's
  packed results and the global plan are unchanged;
* the metadata DCP broadcasts back after a save travels empty: no rank reads it.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, Optional


class PackedWriteResults:
    """One rank's write results (DCP ``WriteResult``s) as one ``bytes`` object of plain
    tuples: cheap to pickle, to gather, and to compare with the previous save's."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    @classmethod
    def from_rows(cls, rows: list[tuple]) -> "PackedWriteResults":
        """``rows``: (fqn, chunk offset or None, index hint, file name, offset in the file,
        length, transform descriptors or None) per entry written."""
        return cls(pickle.dumps(tuple(rows), protocol=pickle.HIGHEST_PROTOCOL))

    def rows(self) -> tuple:
        return pickle.loads(self.blob)

    def storage_index(self) -> dict:
        """{MetadataIndex: _StorageInfo}: where each entry lies, as ``.metadata`` records it."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return {MetadataIndex(fqn, offset, index): _StorageInfo(name, at, length, transform_descriptors=(
                    list(descriptors) if descriptors is not None else None))
                for fqn, offset, index, name, at, length, descriptors in self.rows()}

    def __reduce__(self):
        return (PackedWriteResults, (self.blob,))

    def __len__(self) -> int:
        return len(self.rows())


def storage_index_of(results) -> dict:
    """{MetadataIndex: _StorageInfo} from every rank's write results (packed, or DCP's own
    lists of ``WriteResult`` from a writer that does not pack)."""
    storage: dict = {}
    for rank_results in results:
        if isinstance(rank_results, PackedWriteResults):
            storage.update(rank_results.storage_index())
        else:
            storage.update({r.index: r.storage_data for r in rank_results})
    return storage


def metadata_file_bytes(metadata, storage: dict) -> bytes:
    """The pickled ``.metadata`` of a save: the global metadata with where each entry lies.
    No ``checkpoint_id`` (a step's location is where it is read from; the bytes are then
    the same for every save of an attempt)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    plain = Metadata(**{f.name: getattr(metadata, f.name) for f in dataclasses.fields(Metadata)})
    plain.storage_data, plain.storage_meta, plain.version = storage, StorageMeta(), CURRENT_DCP_VERSION
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def _empty_metadata():
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata(state_dict_metadata={})


_RANK_ZERO_METADATA = None


def _rank_zero_metadata_class():
    """``Metadata`` that pickles as an empty one: what DCP broadcasts to every rank after a
    save (and every rank unpickled: an entry's shapes, chunks and types, for all entries)
    although no rank reads it. Rank 0 keeps the whole object to write ``.metadata``."""
    global _RANK_ZERO_METADATA
    if _RANK_ZERO_METADATA is None:
        from torch.distributed.checkpoint.metadata import Metadata

        class RankZeroMetadata(Metadata):
            def __reduce__(self):
                return (_empty_metadata, ())

        _RANK_ZERO_METADATA = RankZeroMetadata
    return _RANK_ZERO_METADATA


def flat_view(state_dict: Mapping) -> Optional[tuple[dict, dict]]:
    """DCP's ``flatten_state_dict`` for a dict of leaves and dicts of leaves (rayflex's
    ``TrainState.tensor_state``): (flat dict, {flat key: path}), the same as DCP's for
    such a dict, without DCP's generic traversal (a fifth of a save's CPU for a small GPT).
    None for anything else (lists, deeper nesting, ShardedTensors): DCP flattens those."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    flat: dict = {}
    mappings: dict = {}

    def leaf(key: str, path: tuple, value) -> bool:
        if isinstance(value, (Mapping, list, ShardedTensor)) or key in flat:
            return False
        flat[key], mappings[key] = value, path
        return True

    for k1, value in state_dict.items():
        k1 = str(k1)
        if isinstance(value, Mapping):
            for k2, v in value.items():
                k2 = str(k2)
                if not leaf(f"{k1}.{k2}", (k1, k2), v):
                    return None
        elif not leaf(k1, (k1,), value):
            return None
    return flat, mappings


class SavePlanCache:
    """What repeat saves of one checkpointer (one attempt's mesh and state) reuse.

    DCP keys its plan caches by planner class, process-wide; a key per checkpointer keeps
    a reused process's next attempt (another world size, another split) from reading this
    one's plans, and ``clear`` drops them when the attempt ends. Every rank of an attempt
    builds its checkpointer at setup, so all start uncached together and fill their caches
    in the same save.

    This rank's own plan is reused while the state dict holds the very same objects under
    the same keys (an asynchronous save's staged tensors are built once per staging), so
    any re-staged or re-created tensor plans afresh."""

    _CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
               "_cached_metadata")

    def __init__(self, *, in_place_buffers: bool = False) -> None:
        """``in_place_buffers``: the saved tensors are buffers that change only in place
        (an asynchronous save's staging), so the bytes view of each tensor entry is kept
        with the plan and later saves write from it without resolving the entry again."""
        self.key = f"rayflex-{uuid.uuid4().hex}"
        # (the flattened state dict's (key, weak reference to its tensor or None) pairs, this
        # rank's full plan): weak, so a replaced staging's buffers are freed at once.
        self._local: Optional[tuple[list, object]] = None
        self.in_place_buffers = in_place_buffers
        # id(write item of DCP's final plan) -> (that item, memoryview of its tensor's bytes);
        # None when not kept. Emptied whenever this rank plans afresh (other tensors).
        self.payload_views: Optional[dict] = {} if in_place_buffers else None
        # Rank 0: DCP's global metadata -> the object handed to DCP in its place (strong
        # references: the identity checks below cannot be fooled by a reused id).
        self._rank_zero: Optional[tuple[object, object]] = None
        # Rank 0: (global metadata, every rank's packed results, the .metadata bytes written).
        self._metadata_file: Optional[tuple[object, tuple, bytes]] = None

    def planner(self):
        return _planner_class()(self)

    def reusable_local_plan(self, flat_state: dict):
        if self._local is None:
            return None
        entries, plan = self._local
        if len(entries) != len(flat_state):
            return None
        for (key, kept), (now_key, now) in zip(entries, flat_state.items()):
            if key != now_key or (kept is None) == _is_tensor(now) or (kept is not None and kept() is not now):
                return None
        return plan

    def keep_local_plan(self, flat_state: dict, plan) -> None:
        self._local = ([(k, weakref.ref(v) if _is_tensor(v) else None) for k, v in flat_state.items()], plan)
        self.forget_payloads()

    def forget_local(self) -> None:
        """The saved tensors were replaced (a new staging): plan afresh, and let go of the
        old buffers now."""
        self._local = None
        self.forget_payloads()

    def forget_payloads(self) -> None:
        if self.payload_views is not None:
            self.payload_views = {}

    def rank_zero_metadata(self, metadata):
        """The stand-in for DCP's global ``metadata`` (the same one while DCP's is)."""
        if self._rank_zero is None or self._rank_zero[0] is not metadata:
            kept = _rank_zero_metadata_class()(**{f.name: getattr(metadata, f.name)
                                                  for f in dataclasses.fields(metadata)})
            self._rank_zero = (metadata, kept)
        return self._rank_zero[1]

    def metadata_file(self, metadata, results) -> bytes:
        """The ``.metadata`` bytes of a save (rank 0): pickled again only when the global
        metadata or some rank's written layout changed since the last save."""
        packed = tuple(r.blob if isinstance(r, PackedWriteResults) else None for r in results)
        last = self._metadata_file
        if last is not None and last[0] is metadata and None not in packed and last[1] == packed:
            return last[2]
        data = metadata_file_bytes(metadata, storage_index_of(results))
        self._metadata_file = (metadata, packed, data)
        return data

    def clear(self) -> None:
        from torch.distributed.checkpoint.planner import SavePlanner

        for name in self._CACHES:
            getattr(SavePlanner, name, {}).pop(self.key, None)
        self._local = self._rank_zero = self._metadata_file = None
        self.forget_payloads()


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


_PLANNER = None


def _planner_class():
    """DCP's default save planner with plan caching (:class:`SavePlanCache`), the cheap
    flattening of rayflex's state dicts, DTensor shards resolved to their local tensor, and
    a global metadata that is not broadcast back."""
    global _PLANNER
    if _PLANNER is not None:
        return _PLANNER
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.default_planner import _compare_save_plans
    import torch
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
    from torch.distributed.tensor import DTensor

    class CachedSavePlanner(DefaultSavePlanner):
        def __init__(self, cache: SavePlanCache) -> None:
            super().__init__(enable_plan_caching=True)
            self._cached_plans_key = cache.key  # DCP's attribute (its default is the class name)
            self.plan_cache = cache

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
            flat = flat_view(state_dict) if self.flatten_state_dict and self.flatten_sharded_tensors else None
            if flat is None:
                return super().set_up_planner(state_dict, storage_meta, is_coordinator)
            # What DefaultSavePlanner.set_up_planner leaves behind.
            self.state_dict, self.mappings = flat
            self.is_coordinator = is_coordinator

        def create_local_plan(self) -> SavePlan:
            kept = self.plan_cache.reusable_local_plan(self.state_dict)
            if kept is None:
                plan = super().create_local_plan()
                self.plan_cache.keep_local_plan(self.state_dict, self.plan)
                return plan
            # What DefaultSavePlanner.create_local_plan does after listing the items.
            self.plan = kept
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and (cached is kept or _compare_save_plans(kept, cached)):
                return SavePlan([], usable=False)
            self._pending_local_plan = kept
            return kept

        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            return plans, self.plan_cache.rank_zero_metadata(metadata)

        def transform_object(self, write_item, object):
            # torch.load reads torch.save's older format too: a tuple of hyper-parameters
            # takes ~24 us in it against ~66 us in the zip container DCP writes per entry.
            if write_item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(object, buf, _use_new_zipfile_serialization=False)
                return buf
            return object

        def lookup_object(self, index):
            # DTensor.__get_tensor_shard__ is to_local() through autograd: ~10% of a save's
            # CPU for a small GPT; a staged DTensor's local tensor is the shard itself.
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, DTensor) and not any(p.is_partial() for p in obj.placements):
                return obj._local_tensor
            return super().lookup_object(index)

    _PLANNER = CachedSavePlanner
    return _PLANNER
