"""What one session's attention method may ask of the server, checked before anything is allocated.

``check_method(spec, info)`` raises ``ParamError`` naming the hyperparameter at fault when

- a field declared ``param(..., context=True)`` (it counts positions or cache entries: K, C, W, T_r,
  L_min of ReTopK, every method's top_k) exceeds the model's context length ``info.max_context``: no
  larger value means anything more, and some (ReTopK's C and K) size per-session state. A field at the
  method's default or the server's default method's value passes (``check_context``);
- the method's per-session state over every layer would exceed ``STATE_CAP_FACTOR`` times the dense KV
  cache of one full-context sequence of the model (``dense_kv_bytes``). A sparse method whose state
  outweighs the keys and values it saves reading is not worth serving, and the bound keeps one request
  from allocating without limit (ReTopK's state is C x (4 d + 8 K) bytes per query head and layer: the
  default K = 512, C = 32 on SmolLM2-135M is 37.6 MB, the cap at float32 1.5 GB).

The state is measured by building one layer's state of the method on the meta device: no memory is
allocated, and every method is measured by its own code (``method_state_bytes``; the runner's cache budget
uses it too).

``check_server_method`` holds the server's own default method (--method, --method-params) to the same
bounds at startup, where only a field at the method's declared default or at the value the server ships
(runtime/runtime_config.py's DEFAULT_METHOD_PARAMS) passes the context bound unchecked.
"""

from __future__ import annotations

import dataclasses

import torch

from retopk_core.methods.base import AttentionMethod
from retopk_core.params import ParamError, check_context
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.runtime_config import default_method_spec

STATE_CAP_FACTOR = 4  # per-session method state <= this x one full-context sequence's dense KV cache


def dense_kv_bytes(info) -> int:
    """Bytes of the keys and values of one ``info.max_context``-token sequence in the model's dtype."""
    dtype = getattr(torch, str(info.dtype), None)
    size = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * info.max_context * size


def state_cap_bytes(info) -> int:
    """The most method state one session may hold (see the module docstring)."""
    return STATE_CAP_FACTOR * dense_kv_bytes(info)


def method_state_bytes(method: AttentionMethod, info) -> int:
    """Bytes of one session's ``method`` state over every layer of the model, as first allocated."""
    state = method.init_state(info.num_heads, info.num_kv_heads, info.head_dim, device="meta")
    return info.num_layers * state.nbytes_per_slot()


def check_method(spec: MethodSpec, info, default: MethodSpec | None = None) -> None:
    """ParamError naming the field unless ``spec`` fits the model ``info`` (see the module docstring);
    a field at its value in ``default`` (None: the server's, ``info.default_method``) passes the context bound."""
    method = spec.build()  # a bad name or hyperparameter: ParamError
    config = method.config
    if config is not None:
        default = info.default_method if default is None else default
        check_context(config, info.max_context, dict(default.params) if default.name == spec.name else None)
    need, cap = method_state_bytes(method, info), state_cap_bytes(info)
    if need > cap:
        bounded = [f.name for f in dataclasses.fields(config) if f.metadata.get("context")] if config else []
        fields = [name for name in bounded if name in dict(spec.params)] or bounded or ["name"]
        raise ParamError(fields[0], f"the method's state would take {need / 2**20:.1f} MiB per session, more than "
                                    f"the {cap / 2**20:.1f} MiB allowed ({STATE_CAP_FACTOR} x the dense KV cache of "
                                    f"a full {info.max_context}-token context); lower {' or '.join(fields)}")


def check_server_method(spec: MethodSpec, info) -> None:
    """ParamError naming the field unless the server's default method ``spec`` fits the model ``info``."""
    check_method(spec, info, default=default_method_spec())
