"""CEL device selectors evaluated as kube-scheduler evaluates them, with Google's CEL runtime (cel-expr-python).

The Kubernetes device-selector environment has one variable, `device` (driver, attributes and capacity by
domain, allowMultipleAllocations), the standard CEL macros and extensions (strings, `cel.bind`, optionals)
and Kubernetes' `quantity()` and `semver()` libraries. Quantities and versions are opaque to CEL, so they are
carried as two small protobuf messages whose methods are implemented here in Python with exact arithmetic.

A function this environment does not declare is a compile error, reported as `CelUnsupported`
("cannot evaluate: ...") and never guessed; an error while evaluating (a missing attribute, a wrong type)
is a `CelRuntimeError`, which makes kube-scheduler give up on the claim for that node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, Callable

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from api.quantity import quantity_value

# Quantities and versions share one message type: the runtime tells member overloads apart by the kind of
# their arguments only (every message is one kind), so `compareTo` etc. each have one overload that checks.
OPAQUE_TYPE = "k8s.dra.Opaque"
# "<domain>/<id>": resource.kubernetes.io/pcieRoot is device.attributes['resource.kubernetes.io'].pcieRoot.
_QUALIFIED = re.compile(r"^([^/]+)/([^/]+)$")
_STRING_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                     r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
                     r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$")


class CelUnsupported(Exception):
    """The expression uses something this evaluator does not implement: "cannot evaluate: <why>"."""


class CelRuntimeError(Exception):
    """Evaluating the expression for one device failed (as it would in the scheduler)."""


# ------------------------------------------------------------------------------------------ opaque values

def _message_classes() -> tuple[descriptor_pool.DescriptorPool, Any]:
    fdp = descriptor_pb2.FileDescriptorProto(name="k8s_dra_cel.proto", package="k8s.dra", syntax="proto3")
    text = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    optional = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    msg = fdp.message_type.add(name="Opaque")
    msg.field.add(name="kind", number=1, type=text, label=optional)
    # A quantity's exact value as "numerator/denominator": equal quantities are equal messages (CEL `==`).
    msg.field.add(name="text", number=2, type=text, label=optional)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return pool, message_factory.GetMessageClass(pool.FindMessageTypeByName(OPAQUE_TYPE))


_POOL, _Opaque = _message_classes()


def quantity(value: Fraction | int | str) -> Any:
    """The CEL value of a Quantity (a string is read as Kubernetes reads quantities)."""
    v = quantity_value(value) if isinstance(value, str) else Fraction(value)
    return _Opaque(kind="quantity", text=f"{v.numerator}/{v.denominator}")


def _q(msg: Any) -> Fraction:
    if msg.kind != "quantity":
        raise ValueError(f"no such overload: a {msg.kind} is not a quantity")
    num, _, den = msg.text.partition("/")
    return Fraction(int(num), int(den or 1))


def _parse_quantity(text: str) -> Any:
    try:
        return quantity(text)
    except ValueError as exc:
        raise ValueError(f"quantity({text!r}): not a Kubernetes quantity") from exc


def _is_quantity(text: str) -> bool:
    try:
        quantity_value(text)
    except ValueError:
        return False
    return True


def _cmp(a: Any, b: Any) -> int:
    return int(a > b) - int(a < b)


def semver(text: str) -> Any:
    """The CEL value of a semantic version; ValueError for text that is not one (semver 2.0.0)."""
    if not _SEMVER.match(text):
        raise ValueError(f"semver({text!r}): not a semantic version")
    return _Opaque(kind="semver", text=text)


def _semver_match(msg: Any) -> re.Match[str]:
    m = _SEMVER.match(msg.text) if msg.kind == "semver" else None
    if m is None:
        raise ValueError(f"no such overload: a {msg.kind} is not a semver")
    return m


def _semver_key(msg: Any) -> tuple[Any, ...]:
    m = _semver_match(msg)
    assert m is not None
    core = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    if not m.group(4):
        return core + ((1,),)       # a release ranks above all of its pre-releases
    idents = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in m.group(4).split("."))
    return core + ((0, idents),)


def _semver_cmp(a: Any, b: Any) -> int:
    ka, kb = _semver_key(a), _semver_key(b)
    if ka[:3] != kb[:3]:
        return _cmp(ka[:3], kb[:3])
    ra, rb = ka[3], kb[3]
    if ra[0] != rb[0]:
        return _cmp(ra[0], rb[0])
    if ra[0] == 1:
        return 0
    return _cmp(ra[1], rb[1])


def _semver_part(index: int) -> Any:
    def part(msg: Any) -> int:
        return int(_semver_match(msg).group(index))
    return part


def _functions() -> list[cel.FunctionDecl]:
    Q = S = cel.Type(OPAQUE_TYPE)
    B, INT, D, T = cel.Type.BOOL, cel.Type.INT, cel.Type.DOUBLE, cel.Type.STRING

    def fn(name: str, *overloads: tuple[str, Any, list[Any], bool, Any]) -> cel.FunctionDecl:
        return cel.FunctionDecl(name, [cel.Overload(oid, ret, params, member, impl=impl)
                                       for oid, ret, params, member, impl in overloads])

    def is_semver(text: str) -> bool:
        return bool(_SEMVER.match(text))

    return [
        fn("quantity", ("quantity_string", Q, [T], False, _parse_quantity)),
        fn("isQuantity", ("is_quantity_string", B, [T], False, _is_quantity)),
        fn("sign", ("quantity_sign", INT, [Q], True, lambda a: _cmp(_q(a), 0))),
        fn("isInteger", ("quantity_is_integer", B, [Q], True, lambda a: _q(a).denominator == 1)),
        fn("asInteger", ("quantity_as_integer", INT, [Q], True, _as_integer)),
        fn("asApproximateFloat", ("quantity_as_float", D, [Q], True, lambda a: float(_q(a)))),
        fn("add", ("quantity_add", Q, [Q, Q], True, lambda a, b: quantity(_q(a) + _q(b))),
           ("quantity_add_int", Q, [Q, INT], True, lambda a, b: quantity(_q(a) + b))),
        fn("sub", ("quantity_sub", Q, [Q, Q], True, lambda a, b: quantity(_q(a) - _q(b))),
           ("quantity_sub_int", Q, [Q, INT], True, lambda a, b: quantity(_q(a) - b))),
        fn("compareTo", ("opaque_compare", INT, [Q, Q], True, _compare)),
        fn("isLessThan", ("opaque_less", B, [Q, Q], True, lambda a, b: _compare(a, b) < 0)),
        fn("isGreaterThan", ("opaque_greater", B, [Q, Q], True, lambda a, b: _compare(a, b) > 0)),
        fn("semver", ("semver_string", S, [T], False, semver)),
        fn("isSemver", ("is_semver_string", B, [T], False, is_semver)),
        fn("major", ("semver_major", INT, [S], True, _semver_part(1))),
        fn("minor", ("semver_minor", INT, [S], True, _semver_part(2))),
        fn("patch", ("semver_patch", INT, [S], True, _semver_part(3))),
    ]


def _compare(a: Any, b: Any) -> int:
    """compareTo of two quantities or two versions."""
    if a.kind != b.kind:
        raise ValueError(f"no such overload: compareTo({a.kind}, {b.kind})")
    return _semver_cmp(a, b) if a.kind == "semver" else _cmp(_q(a), _q(b))


def _as_integer(a: Any) -> int:
    v = _q(a)
    if v.denominator != 1 or not -(1 << 63) <= v.numerator < (1 << 63):
        raise ValueError("asInteger: the quantity is not an int64")
    return v.numerator


@lru_cache(maxsize=1)
def _env() -> cel.Env:
    extensions = [ext_bindings.ExtBindings(), ext_optional.ExtOptional(), ext_strings.ExtStrings()]
    return cel.NewEnv(_POOL, variables={"device": cel.Type.DYN}, extensions=extensions, functions=_functions())


# --------------------------------------------------------------------------------------- device variable

def split_qualified(name: str, driver: str) -> tuple[str, str]:
    """(domain, id) of an attribute or capacity name: an unqualified name is in the driver's own domain."""
    m = _QUALIFIED.match(name)
    return (m.group(1), m.group(2)) if m else (driver, name)


def attribute_value(attr: dict[str, Any]) -> Any:
    """The CEL value of a DeviceAttribute ({"int": 1} -> 1, {"version": "1.2.3"} -> semver)."""
    for kind in ("int", "bool", "string"):
        if kind in attr:
            return attr[kind]
    if "version" in attr:
        return semver(str(attr["version"]))
    for kind in ("ints", "bools", "strings"):
        if kind in attr:
            return list(attr[kind])
    if "versions" in attr:
        return [semver(str(v)) for v in attr["versions"]]
    raise ValueError(f"attribute without a value: {attr}")


def device_variable(driver: str, device: dict[str, Any]) -> dict[str, Any]:
    """The `device` variable of the selector environment for one ResourceSlice device."""
    attributes: dict[str, dict[str, Any]] = {driver: {}}
    capacity: dict[str, dict[str, Any]] = {driver: {}}
    for name, attr in (device.get("attributes") or {}).items():
        domain, ident = split_qualified(name, driver)
        attributes.setdefault(domain, {})[ident] = attribute_value(attr)
    for name, cap in (device.get("capacity") or {}).items():
        domain, ident = split_qualified(name, driver)
        capacity.setdefault(domain, {})[ident] = quantity(str(cap.get("value", "0")))
    return {"driver": driver, "attributes": attributes, "capacity": capacity,
            "allowMultipleAllocations": bool(device.get("allowMultipleAllocations"))}


@dataclass(frozen=True)
class Selector:
    """One compiled CEL selector expression."""

    expression: str
    program: Any
    # String literals of the expression: an unknown domain looked up by one of them is an empty map, as in
    # Kubernetes (so `has(device.attributes['other.io'].x)` is false instead of an error).
    literals: frozenset[str]

    def matches(self, device: dict[str, Any]) -> bool:
        """Whether the `device` variable (see device_variable) satisfies the expression."""
        data = device
        missing = [lit for lit in self.literals
                   if lit not in device["attributes"] or lit not in device["capacity"]]
        if missing:
            data = {**device, "attributes": dict(device["attributes"]), "capacity": dict(device["capacity"])}
            for lit in missing:
                data["attributes"].setdefault(lit, {})
                data["capacity"].setdefault(lit, {})
        try:
            value = self.program.eval(data={"device": data})
        except Exception as exc:  # noqa: BLE001 - the runtime raises plain exceptions from Python callbacks
            raise CelRuntimeError(str(exc)) from exc
        if value.type() == cel.Type.ERROR:
            raise CelRuntimeError(str(value.value()))
        result = value.value()
        if not isinstance(result, bool):
            raise CelRuntimeError(f"the expression returned {value.type().name().lower()}, not bool")
        return result


# ------------------------------------------------------------------------- results shared between devices

# What of the device a selector reads: ("driver",), ("allowMultipleAllocations",), ("attributes", domain, id) or
# ("capacity", domain, id). Two devices that agree on every input of an expression get the same result from it.
Input = tuple[str, ...]
_ABSENT = ("<absent>",)
_DEVICE_REF = re.compile(
    r"device\s*\.\s*(?:(driver|allowMultipleAllocations)\b(?!\s*\()|(attributes|capacity)\s*\[\s*(?:'([^'\\]*)'"
    r"|\"([^\"\\]*)\")\s*\]\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\())")
_IDENT_CHAR = re.compile(r"[A-Za-z0-9_]")


def _literal_spans(expression: str) -> list[tuple[int, int]] | None:
    """Where the string literals are; None for a form this reader does not follow (raw, bytes or triple-quoted)."""
    spans, i, n = [], 0, len(expression)
    while i < n:
        ch = expression[i]
        if ch in "'\"":
            if expression.startswith(ch * 3, i) or (i and expression[i - 1] in "rRbB"):
                return None
            j = i + 1
            while j < n and expression[j] != ch:
                j += 2 if expression[j] == "\\" else 1
            if j >= n:
                return None
            spans.append((i, j + 1))
            i = j + 1
        else:
            i += 1
    return spans


@lru_cache(maxsize=1024)
def selector_inputs(expression: str) -> tuple[Input, ...] | None:
    """The device inputs of an expression when every use of ``device`` in it is a plain read of ``driver``,
    ``allowMultipleAllocations`` or one named attribute or capacity (``device.attributes['<domain>'].<id>``);
    None when the expression uses ``device`` otherwise (as a whole, a domain map, an index by a variable), and
    then its result is never shared between devices."""
    spans = _literal_spans(expression)
    if spans is None:
        return None
    inputs: list[Input] = []
    for m in re.finditer(r"device", expression):
        at = m.start()
        if any(a <= at < b for a, b in spans):
            continue
        before = expression[at - 1] if at else " "
        after = expression[m.end()] if m.end() < len(expression) else " "
        if _IDENT_CHAR.match(before) or _IDENT_CHAR.match(after):
            continue                                    # part of another name (devices, mydevice)
        ref = _DEVICE_REF.match(expression, at)
        if ref is None or before == ".":
            return None
        if ref.group(1):
            inputs.append((ref.group(1),))
        else:
            inputs.append((ref.group(2), ref.group(3) if ref.group(3) is not None else ref.group(4), ref.group(5)))
    return tuple(dict.fromkeys(inputs))


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1:
            ((k, v),) = value.items()
            return (k, tuple(v) if isinstance(v, list) else v)
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


class _Unshared(Exception):
    """An input that cannot be read off the device without building its variable (one attribute named twice)."""


@lru_cache(maxsize=4096)
def _qualified(domain: str, ident: str) -> str:
    return f"{domain}/{ident}"


def _input_value(driver: str, device: dict[str, Any], ref: Input) -> Any:
    if len(ref) == 1:
        return driver if ref[0] == "driver" else bool(device.get("allowMultipleAllocations"))
    kind, domain, ident = ref
    entries = device.get(kind) or {}
    qualified = entries.get(_qualified(domain, ident))
    plain = entries.get(ident) if domain == driver else None
    if qualified is not None and plain is not None:
        raise _Unshared()                       # which one counts depends on their order: no sharing
    value = qualified if qualified is not None else plain
    if value is None:
        return _ABSENT
    if kind != "attributes":
        return str((value or {}).get("value", "0"))
    if len(value) == 1:                         # {"string": "gpu"}: the common case, without recursion
        ((k, v),) = value.items()
        if not isinstance(v, (list, dict)):
            return k, v
    return _frozen(value)


class SelectorResults:
    """Selector results shared between devices that agree on the expression's inputs (selector_inputs): across
    the nodes of a fleet most devices look alike to a class's selectors, which are then evaluated once per kind
    of device instead of once per device. Results and runtime errors are both kept; bounded by ``limit``."""

    def __init__(self, limit: int = 200_000) -> None:
        self._results: dict[tuple[Any, ...], bool | CelRuntimeError] = {}
        self._limit = limit

    def matches(self, expression: str, driver: str, device: dict[str, Any], variable: Callable[[], Any]) -> bool:
        """Whether the device (a ResourceSlice device of ``driver``) satisfies the expression; ``variable()``
        gives its device variable when the result must be computed."""
        refs = selector_inputs(expression)
        try:
            if refs is None:
                raise _Unshared()
            key = (expression, *(_input_value(driver, device, r) for r in refs))
        except _Unshared:
            return compile_selector(expression).matches(variable())
        result = self._results.get(key)
        if result is None:
            try:
                result = compile_selector(expression).matches(variable())
            except CelRuntimeError as exc:
                result = exc
            if len(self._results) >= self._limit:
                self._results.clear()
            self._results[key] = result
        if isinstance(result, CelRuntimeError):
            raise result
        return result


@lru_cache(maxsize=1024)
def compile_selector(expression: str) -> Selector:
    """Compiles (and type-checks) an expression; CelUnsupported names what this environment lacks."""
    try:
        program = _env().compile(expression)
    except Exception as exc:  # noqa: BLE001 - compile errors come as RuntimeError with the checker's text
        text = str(exc).replace("INVALID_ARGUMENT: ", "").replace(" [INVALID_ARGUMENT]", "")
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise CelUnsupported(first.removeprefix("ERROR: <input>:")) from exc
    literals = frozenset(a or b for a, b in _STRING_LITERAL.findall(expression))
    return Selector(expression, program, literals)
