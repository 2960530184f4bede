"""Setting a wire field from a Python value with a message that names the field, and an attention method from
its name or a mapping of its hyperparameters: the client SDK builds its requests with these and the server's
HTTP front builds the GenerateRequest of a JSON body with them, so both read a value alike.

protobuf's own TypeError names neither the field nor what was expected; ``FieldValueError`` does.
"""

from __future__ import annotations

from collections.abc import Mapping

from retopk_proto.retopk.v1 import retopk_pb2 as pb

# From the proto's descriptors (the wire contract defines them once): the named ReTopK fields of
# AttentionMethod in proto order (K, C, W, R, tau, T_r).
RETOPK_FIELDS = tuple(f.name for f in pb.AttentionMethod.DESCRIPTOR.fields if f.name not in ("name", "params"))

ParamValue = int | float | str | bool


class FieldValueError(TypeError, ValueError):
    """A value the wire field cannot hold (a string for an integer, a float for an int32, a number past its
    range); ``field`` names it ("top_k", "sampling.seed", "params['sink']"). Raised before anything is sent."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message

    def within(self, prefix: str) -> FieldValueError:
        """The same error naming the field inside ``prefix`` ("sampling" -> "sampling.top_k")."""
        return FieldValueError(f"{prefix}.{self.field}", self.reason)


_FD = pb.SamplingParameters.DESCRIPTOR.fields[0].__class__
_INTS = {_FD.CPPTYPE_INT32: 31, _FD.CPPTYPE_INT64: 63, _FD.CPPTYPE_UINT32: 32, _FD.CPPTYPE_UINT64: 64}
_FLOATS = (_FD.CPPTYPE_FLOAT, _FD.CPPTYPE_DOUBLE)


def set_field(message, name: str, value, field: str) -> None:
    """``message.name = value`` after checking that the field's wire type holds it (FieldValueError naming
    ``field`` otherwise)."""
    fd = message.DESCRIPTOR.fields_by_name[name]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if fd.cpp_type in _INTS:
        bits, unsigned = _INTS[fd.cpp_type], fd.cpp_type in (_FD.CPPTYPE_UINT32, _FD.CPPTYPE_UINT64)
        if not number or not isinstance(value, int):
            raise FieldValueError(field, f"must be an integer, got {value!r:.60}")
        low, high = (0, 2 ** bits - 1) if unsigned else (-(2 ** bits), 2 ** bits - 1)
        if not low <= value <= high:
            raise FieldValueError(field, f"must lie in [{low}, {high}], got {value}")
    elif fd.cpp_type in _FLOATS and not number:
        raise FieldValueError(field, f"must be a number, got {value!r:.60}")
    elif fd.cpp_type == _FD.CPPTYPE_BOOL and not isinstance(value, bool):
        raise FieldValueError(field, f"must be true or false, got {value!r:.60}")
    elif fd.cpp_type == _FD.CPPTYPE_STRING and not isinstance(value, str):
        raise FieldValueError(field, f"must be a string, got {value!r:.60}")
    setattr(message, name, value)


def param_message(key: str, value: ParamValue) -> pb.ParamValue:
    """A hyperparameter outside RETOPK_FIELDS as its wire value (FieldValueError naming ``key``)."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return pb.ParamValue(bool_value=value)
    if isinstance(value, int):
        if not -(2 ** 63) <= value < 2 ** 63:
            raise FieldValueError(key, f"must lie in [{-(2 ** 63)}, {2 ** 63 - 1}], got {value}")
        return pb.ParamValue(int_value=value)
    if isinstance(value, float):
        return pb.ParamValue(float_value=value)
    if isinstance(value, str):
        return pb.ParamValue(string_value=value)
    raise FieldValueError(key, f"must be an integer, a number, a string or true/false, got {type(value).__name__}")


def split_method(value: Mapping) -> tuple[dict, dict]:
    """A method mapping's keys -> (name and RETOPK_FIELDS, every other hyperparameter): keys outside the named
    fields go to params, beside those of its own ``params`` mapping."""
    known = {"name", *RETOPK_FIELDS}
    params = dict(value.get("params", {}))
    params.update({k: v for k, v in value.items() if k not in known and k != "params"})
    return {k: v for k, v in value.items() if k in known}, params


def method_message(name: str, named: Mapping[str, ParamValue | None], params: Mapping[str, ParamValue]) \
        -> pb.AttentionMethod:
    """The AttentionMethod of a method's name, its named fields (None: the server's default) and its other
    hyperparameters; FieldValueError naming the hyperparameter its type cannot hold."""
    msg = pb.AttentionMethod()
    set_field(msg, "name", name, "name")
    for f in RETOPK_FIELDS:
        if named.get(f) is not None:
            set_field(msg, f, named[f], f)
    for key, value in params.items():
        msg.params[key].CopyFrom(param_message(key, value))
    return msg
