"""Request bodies of the API and the dashboard's forms (pydantic; strict numbers, finite floats).

The response bodies are the daemon's typed contract in ``sparkd.loop.status``
(``Status``, ``ResizeResult``).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sparkd.core.choices import KvCacheDtype
from sparkd.errors import InvalidInput


class ResizeRequest(BaseModel):
    """``POST /api/resize``: the budget knobs to change (GiB at this edge). Unset = keep.

    ``dry_run`` defaults to true: nothing changes unless a client asks for it.
    Numbers are strict: ``true`` is not 1, ``"8"`` is not 8, ``4096.5`` is not an
    integer; a JSON integer is fine for a float field (2 → 2.0). NaN and ±Infinity
    (which Python's JSON parser accepts) are refused.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kv_target_gib: float | None = Field(default=None, ge=0, le=1024, strict=True)
    max_model_len: int | None = Field(default=None, ge=1, le=16_777_216, strict=True)
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096, strict=True)
    host_reserve_gib: float | None = Field(default=None, ge=0, le=1024, strict=True)
    kv_cache_dtype: KvCacheDtype | None = None
    gmu_override: float | None = Field(default=None, gt=0, le=1, strict=True)
    docker_headroom_gib: float | None = Field(default=None, ge=0, le=1024, strict=True)
    dry_run: bool = True

    def changes(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True, exclude={"dry_run"})


RESIZE_INT_FIELDS = frozenset({"max_model_len", "max_num_seqs"})
RESIZE_FLOAT_FIELDS = frozenset({"kv_target_gib", "host_reserve_gib", "gmu_override", "docker_headroom_gib"})


def form_to_resize(form: dict[str, str]) -> dict[str, Any]:
    """Dashboard form strings → ``ResizeRequest`` input (the model is strict; forms only have strings).

    A number that does not parse stays a string, so the model names the field.
    """
    data: dict[str, Any] = {k: v.strip() for k, v in form.items() if k != "csrf_token" and v.strip() != ""}
    for k, v in data.items():
        try:
            if k in RESIZE_INT_FIELDS:
                data[k] = int(v)
            elif k in RESIZE_FLOAT_FIELDS:
                data[k] = float(v)
        except ValueError:
            pass
    if "dry_run" in data:
        data["dry_run"] = data["dry_run"].lower() in ("1", "true", "yes", "on")
    return data


def require_finite(field: str, value: float | None) -> None:
    """Query parameters: refuse NaN and ±Infinity (``since=nan``, ``1e999``) naming the field.

    Raises:
        InvalidInput: ``value`` is not finite.
    """
    if value is not None and not math.isfinite(value):
        raise InvalidInput(field, value, "a finite number")
