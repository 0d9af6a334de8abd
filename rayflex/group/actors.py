"""Small facts about Ray actor handles that every part of the group layer needs."""

from __future__ import annotations


def kill_quietly(actor) -> None:
    """``ray.kill`` an actor that may already be dead (or whose node is gone)."""
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass


def actor_id(actor) -> str:
    return actor._actor_id.hex()
