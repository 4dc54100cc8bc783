"""Proof, on an attention module itself, that its keys can be stored unrotated.

Position-free keys need one thing of a model's attention module: RoPE is the *last* thing done
to ``q`` and ``k`` before they reach the attention layer, done by a rotary module reachable as an
attribute, so that minipic can rotate only the query there and rotate keys inside attention at
their logical positions (``engine_ext/attention/unrotated_keys.py``). Rather than a list of
attention classes checked by hand (which every new family would have to join), this reads the
module's own ``forward`` and accepts it only when its source shows exactly that shape::

    q, k = self.<rope>(<positions>, q, k)      # optionally the only statement of `if self.flag:`
    ...                                        # statements that neither read nor write q or k
    out = self.<attn>(q, k, v)

where ``<positions>`` is a parameter of ``forward`` it never reassigns (the physical positions
vLLM passes, which attention shifts to logical ones), ``<rope>`` is called nowhere else in
``forward`` and ``<attn>`` nowhere else either. Anything else is refused with the reason:
a norm or a scale applied after RoPE (Llama 4's ``qk_norm``, NoPE temperature tuning), keys
assembled around a rotated part (DeepSeek's MLA and its decoupled RoPE), rotation done inside
another library's attention (vLLM's Transformers backend: OLMo 2 in vLLM 0.32), positions
rewritten before rotation. What happens *inside* the rotary module is checked separately
(``unrotated_keys.table_lookup_rope``), and what the attention layer does with the keys by the
backend (``rope_unsupported_reason``: sliding windows, sinks, soft-capping).

Why the source and not a trace: a trace needs a forward context, weights and a backend; the
source is there as soon as the class is, and the checks run before weights load. A class whose
source cannot be read (compiled, generated) is refused, not guessed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RotaryShape:
    """What the proof found in a class's ``forward``: the attribute names of its rotary module
    and attention layer, and the ``self`` flag guarding the rotation (None: unconditional)."""

    rope_attr: str
    attn_attr: str
    guard_attr: str | None
    # ``if self.X:`` blocks between RoPE and attention that change q or k: sound only where the
    # instance has X off (Mistral's Llama-4 query scaling)
    off_flags: tuple[str, ...] = ()


def prove(module: Any) -> tuple[RotaryShape | None, str | None]:
    """``(shape, None)`` when ``module``'s forward rotates q and k right before its attention
    call (and the guarding flag, if any, is set on this instance); ``(None, reason)`` if not."""
    shape, reason = _prove_class(type(module))
    if shape is None:
        return None, reason
    if shape.guard_attr is not None and not getattr(module, shape.guard_attr, False):
        return None, (f"{type(module).__name__}.{shape.guard_attr} is off: this layer does not "
                      f"rotate (NoPE), so its keys carry no position to remove")
    for flag in shape.off_flags:
        if getattr(module, flag, True):
            return None, (f"{type(module).__name__}.{flag} is on: its forward changes q or k "
                          f"between RoPE and attention")
    return shape, None


@functools.cache
def _prove_class(cls: type) -> tuple[RotaryShape | None, str | None]:
    forward = getattr(cls, "forward", None)
    name = cls.__name__
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as exc:
        return None, f"{name}.forward: source not readable ({type(exc).__name__})"
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        return None, f"{name}.forward is not a plain function"
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    rotations = [c for c in ast.walk(fn) if _self_call(c) and _self_call(c).endswith("rotary_emb")]
    if not rotations:
        where = (" (vLLM runs this model through its Transformers backend, which rotates inside "
                 "transformers' own attention code)" if cls.__module__.startswith("transformers.")
                 else "")
        return None, f"{name}.forward calls no rotary module (self.*rotary_emb){where}"
    if len(rotations) > 1:
        return None, f"{name}.forward calls its rotary module {len(rotations)} times"
    return _prove_body(name, fn, fn.body, params, None)


def _prove_body(name: str, fn: ast.AST, body: list[ast.stmt], params: set[str],
                guard: str | None) -> tuple[RotaryShape | None, str | None]:
    """Find the rotation in ``body`` (or as the whole of an ``if self.flag:`` in it) and check
    the statements from there to the attention call."""
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 \
                and _rotation(stmt.body[0]) is not None:
            flag = _flag(stmt.test)
            if flag is None:
                return None, f"{name}.forward rotates under a condition other than self.<flag>"
            return _after_rotation(name, fn, stmt.body[0], body[i + 1:], params, flag)
        if _rotation(stmt) is not None:
            return _after_rotation(name, fn, stmt, body[i + 1:], params, guard)
    return None, (f"{name}.forward does not rotate as a statement of its own body "
                  f"(`q, k = self.rotary_emb(positions, q, k)`)")


def _after_rotation(name: str, fn: ast.AST, rotation: ast.stmt, rest: list[ast.stmt],
                    params: set[str], guard: str | None) -> tuple[RotaryShape | None, str | None]:
    rope_attr, pos, q, k = _rotation(rotation)  # type: ignore[misc]
    if pos not in params:
        return None, f"{name}.forward rotates at {pos!r}, not at a parameter of forward"
    if _assigned(fn, pos):
        return None, f"{name}.forward reassigns {pos!r} (positions other than vLLM's)"
    off_flags: list[str] = []
    for stmt in rest:
        attn = _attention_call(stmt)
        if attn is not None:
            attn_attr, args = attn
            if args[:2] != [q, k]:
                return None, (f"{name}.forward passes {args[:2]} to self.{attn_attr}, not the "
                              f"rotated {q}, {k}")
            calls = [c for c in ast.walk(fn) if _self_call(c) == attn_attr]
            if len(calls) != 1:
                return None, f"{name}.forward calls self.{attn_attr} {len(calls)} times"
            return RotaryShape(rope_attr, attn_attr, guard, tuple(off_flags)), None
        touched = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)} & {q, k}
        flag = _flag(stmt.test) if isinstance(stmt, ast.If) and not stmt.orelse else None
        if touched and flag is not None and not isinstance(stmt.test, ast.Compare):
            off_flags.append(flag)  # decided per instance, in prove()
        elif touched:
            return None, (f"{name}.forward changes or reads {sorted(touched)} between RoPE and "
                          f"attention (line `{ast.unparse(stmt).splitlines()[0]}`): the cached "
                          f"key would not be the one RoPE is removed from")
    return None, f"{name}.forward does not pass the rotated q, k to an attention layer"


def _rotation(stmt: ast.stmt) -> tuple[str, str, str, str] | None:
    """``(rope attribute, positions, q, k)`` of ``q, k = self.<rope>(positions, q, k)``."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target, call = stmt.targets[0], stmt.value
    attr = _self_call(call)
    if attr is None or not attr.endswith("rotary_emb") or not isinstance(target, ast.Tuple):
        return None
    names = [t.id for t in target.elts if isinstance(t, ast.Name)]
    args = [a.id for a in call.args if isinstance(a, ast.Name)]  # type: ignore[attr-defined]
    if len(names) != 2 or len(args) != 3 or call.keywords or args[1:] != names:  # type: ignore[attr-defined]
        return None
    return attr, args[0], names[0], names[1]


def _attention_call(stmt: ast.stmt) -> tuple[str, list[str]] | None:
    """``(attribute, argument names)`` of ``x = self.<attn>(q, k, v)`` where ``<attn>`` ends
    in ``attn``."""
    value = stmt.value if isinstance(stmt, ast.Assign | ast.Return | ast.Expr) else None
    attr = _self_call(value) if value is not None else None
    if attr is None or not attr.endswith("attn"):
        return None
    return attr, [a.id if isinstance(a, ast.Name) else "" for a in value.args]  # type: ignore[union-attr]


def _self_call(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Call):
        return _self_attr(node.func)
    return None


def _self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return node.attr
    return None


def _flag(test: ast.expr) -> str | None:
    """``X`` of a guard ``self.X`` or ``self.X is not None`` (the instance decides)."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 \
            and isinstance(test.ops[0], ast.IsNot) \
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
        test = test.left
    return _self_attr(test)


def _assigned(fn: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
               for n in ast.walk(fn))
