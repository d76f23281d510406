"""The bodies of the membership routes (``POST /scale``, SGLang's ``/scale_elastic_ep``): strict ints,
no other keys, so that a malformed one is refused by validation (400)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ScaleRequest(BaseModel):
    """``POST /scale``: the membership wanted (what the mode scales; afd: ``ffn``, FFN daemons; asap:
    ``moe``, MoE workers; ``ep_size``: either)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    ffn: int | None = Field(None, ge=1)
    moe: int | None = Field(None, ge=1)
    ep_size: int | None = Field(None, ge=1)
    attention: int | None = Field(None, ge=1)
    new_ep_size: int | None = Field(None, ge=1)  # SGLang's name for ep_size
    prefill: int | None = Field(None, ge=1)  # pd: prefill instances
    decode: int | None = Field(None, ge=1)  # pd: decode instances
    drain: bool | None = None  # attention: a leaver's requests finish there (default: handed over if shared)


class ScaleElasticEpRequest(BaseModel):
    """SGLang's ``POST /scale_elastic_ep``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    new_ep_size: int = Field(ge=1)

