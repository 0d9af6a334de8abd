"""The storage URI schemes rayflex reads and writes, and the fsspec package each needs.

One table, at the bottom of the layers, so that ``config`` (which validates URIs before any
work starts) and ``storage`` (which opens them) agree without importing each other.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Optional

from rayflex.errors import ConfigError


@dataclass(frozen=True)
class ObjectStore:
    """An object-store scheme: its fsspec package and the rayflex extra that installs it."""

    family: str            # "s3", "gs" or "az": one per service, whatever the alias
    service: str           # the service's name in messages
    module: str            # the fsspec implementation's import name
    extra: Optional[str]   # ``pip install 'rayflex[extra]'``; None: a core dependency


S3 = ObjectStore("s3", "S3", "s3fs", None)
GCS = ObjectStore("gs", "GCS", "gcsfs", "gcp")
AZURE = ObjectStore("az", "Azure Blob", "adlfs", "azure")
OBJECT_STORES = {"s3": S3, "gs": GCS, "gcs": GCS, "az": AZURE, "abfs": AZURE, "abfss": AZURE}
SUPPORTED_SCHEMES = ("file", "memory", *OBJECT_STORES)


def redact_uri(uri: str) -> str:
    """Hide ``user:password@`` in a URI before it goes into a message."""
    return re.sub(r"^([a-zA-Z0-9+.-]+://)[^/@]*@", r"\1***@", uri)


def check_backend(uri: str, *, field: str = "storage uri") -> Optional[ObjectStore]:
    """The object store of ``uri`` (None for file/memory/bare paths), after importing its
    fsspec package; a ConfigError naming the extra that installs it if it is missing."""
    if not isinstance(uri, str) or "://" not in uri:
        return None
    store = OBJECT_STORES.get(uri.split("://", 1)[0].lower())
    if store is None:
        return None
    try:
        importlib.import_module(store.module)
    except ImportError as err:
        install = f"pip install 'rayflex[{store.extra}]'" if store.extra else f"pip install {store.module}"
        raise ConfigError(field, f"{redact_uri(uri)!r} needs the {store.module} package "
                          f"({store.service}), which cannot be imported: {err}",
                          f"install it with `{install}`") from err
    return store
