"""`calculator`: multi-step arithmetic where the model may call a calculator by writing `<calc>expression</calc>`.

A turn that ends with a call gets the result back as the next message (`<result>...</result>`, or `<result>error:
...</result>` for a malformed or refused expression, which counts as a tool error and lets the episode go on); a turn
without a call is the final answer, scored by the task's rewards (the arithmetic task's: the last number). With
`retries` > 0 a wrong final answer is told so and may try again, up to `retries` times (multi-turn self-correction, and
multi-turn episodes even for a model too small to call the tool).

The expression is never `eval`-ed: it is parsed with Python's `ast` and only numbers, + - * / // %, unary signs,
parentheses and `**` with a small exponent are walked; names, calls, attributes, subscripts, strings and everything
else are refused, as are expressions longer than `MAX_CHARS`, deeper than `MAX_NODES` nodes, and any intermediate
value whose magnitude exceeds `MAX_VALUE`.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction

from inflight.envs.base import EpisodeState, Feedback
from inflight.tasks.arithmetic import reward
from inflight.tasks.base import Message, Problem

MAX_CHARS = 200
MAX_NODES = 64
MAX_VALUE = 10**15
MAX_EXPONENT = 16
CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
INSTRUCTIONS = (
    "You can use a calculator: write <calc>expression</calc> (numbers, + - * / and parentheses) and "
    "wait for the <result>. When you know the answer, reply with only the number."
)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the model reads back."""


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression` under the whitelist of the module docstring, or `CalcError` saying why not."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if node.value != node.value or abs(node.value) == float("inf"):
            raise CalcError(f"result larger than {MAX_VALUE}")
        return _bounded(Fraction(repr(node.value)))  # 0.1 as 1/10, not the binary float's exact value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalcError("division by zero")
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalcError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_power(base: Fraction, exponent: Fraction) -> None:
    """Refuse a power before computing it: 9**9**9 must not run for minutes to find out it is too large."""
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    magnitude = math.log10(max(abs(base.numerator), base.denominator))
    if magnitude * abs(exponent) > math.log10(MAX_VALUE) + 1e-9:
        raise CalcError(f"result larger than {MAX_VALUE}")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_VALUE or value.denominator > MAX_VALUE:
        raise CalcError(f"result larger than {MAX_VALUE}")
    return value


def show(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal with at most 6 places ("2.5", "0.333333")."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


class Calculator:
    """The built-in `--env calculator`. `max_calls`: calculator calls per episode before a call is refused (the
    episode is also bounded by `--max-turns`); `role`: the role of the result messages (\"user\" works with every chat
    template; \"tool\" where the template knows it); `retries`: wrong final answers told to try again."""

    stop = ("</calc>",)
    run_inline = True  # quick and never blocking: called on the serve's event loop, not in a thread

    def __init__(self, max_calls: int = 8, role: str = "user", retries: int = 0):
        if max_calls < 1:
            raise ValueError(f"env_args max_calls is {max_calls}, expected >= 1")
        if role not in ("user", "tool"):
            raise ValueError(f"env_args role is {role!r}, expected 'user' or 'tool'")
        if retries < 0:
            raise ValueError(f"env_args retries is {retries}, expected >= 0")
        self.max_calls, self.role, self.retries = max_calls, role, retries

    def reset(self, problem: Problem) -> list[Message]:
        messages = problem.chat()
        if messages[0]["role"] == "system":  # one system message: the task's, with the tool's instructions first
            return [{"role": "system", "content": f"{INSTRUCTIONS}\n\n{messages[0]['content']}"}, *messages[1:]]
        return [{"role": "system", "content": INSTRUCTIONS}, *messages]

    def step(self, state: EpisodeState, completion: str) -> Feedback:
        call = CALL.search(completion)
        if call is None:  # a final answer: the task's reward scores the last one
            wrong = reward(completion, state.problem.answer) == 0.0
            tries = state.data["retries"] = state.data.get("retries", 0) + wrong
            if wrong and tries <= self.retries:
                return Feedback(
                    [{"role": "user", "content": "That is not right. Try again: reply with only the number."}]
                )
            return Feedback(done=True)
        calls = state.data["calls"] = state.data.get("calls", 0) + 1
        try:
            if calls > self.max_calls:
                raise CalcError(f"no calls left (at most {self.max_calls}): give your answer")
            result, errors = show(evaluate(call.group(1))), 0
        except CalcError as exc:
            result, errors = f"error: {exc}", 1
        return Feedback([{"role": self.role, "content": f"<result>{result}</result>"}], tool_errors=errors)
