"""Reading OpenAI request bodies: typed fields, the served model, and parameters not supported.

Every field a worker request may carry is either read (with its type checked), or known
to be harmless at the value sent (``user``, a ``frequency_penalty`` of 0, ...), or refused
with a 400 that names it: a parameter that would change the output is never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pool.errors import PoolError

__all__ = [
    "HARMLESS",
    "CompletionRequestError",
    "ModelNotFoundError",
    "bool_field",
    "check_parameters",
    "decode_body",
    "float_field",
    "int_field",
    "model_request",
    "served_model",
]


class CompletionRequestError(PoolError, ValueError):
    """A request body is malformed or asks for something unsupported (a 400).

    Attributes:
        param: The offending parameter, when one is to blame.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(CompletionRequestError):
    """The request names a model this worker does not serve (a 404 ``model_not_found``)."""


HARMLESS: Final[Mapping[str, tuple[Any, ...] | None]] = {
    # No effect on what is generated.
    "user": None,
    "metadata": None,
    "store": None,
    "service_tier": None,
    "parallel_tool_calls": None,
    "request_id": None,
    "priority": (0,),
    # Neutral values of what the worker does not implement.
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "min_tokens": (0,),
    "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (),
    "return_tokens_as_token_ids": (False,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "chat_template": (),
    "continue_final_message": (False,),
    "truncate_prompt_tokens": (),
    "functions": ([],),
    "function_call": ("none", "auto"),
}
"""Parameters a worker does not implement -> the values that change nothing (``None``:
every value; ``null`` always does). Any other value is refused, naming the parameter."""


def decode_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (``NaN`` and ``Infinity`` refused: not JSON).

    Raises:
        CompletionRequestError: Not JSON, or not an object.
    """
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise CompletionRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CompletionRequestError("the body must be a JSON object")
    return body


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def check_parameters(body: Mapping[str, Any], read: frozenset[str]) -> None:
    """Refuse any parameter neither ``read`` by the endpoint nor harmless at its value.

    Raises:
        CompletionRequestError: Naming the first such parameter and what it would need.
    """
    for name, value in body.items():
        if name in read or value is None:
            continue
        if name not in HARMLESS:
            raise CompletionRequestError(
                f"unknown parameter {name!r}: this worker does not support it", name
            )
        harmless = HARMLESS[name]
        if harmless is not None and not _among(value, harmless):
            raise CompletionRequestError(
                f"parameter {name!r} = {json.dumps(value)[:80]} is not supported by this "
                "worker; leave it out" + _neutral_text(harmless),
                name,
            )


def _among(value: Any, allowed: Sequence[Any]) -> bool:
    # bool is an int in Python: 0 == False, so compare types as JSON does.
    return any(type(value) is type(a) or _both_numbers(value, a) for a in allowed if value == a)


def _both_numbers(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return (
        isinstance(a, numbers)
        and isinstance(b, numbers)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    )


def _neutral_text(allowed: Sequence[Any]) -> str:
    if not allowed:
        return ""
    return " or send " + " or ".join(json.dumps(a) for a in allowed)


def served_model(body: Mapping[str, Any], served: Sequence[str]) -> str:
    """The model a request asks for, as its answer names it.

    A request without ``model`` (or with ``null``) gets the first served name, as vLLM
    serves its only model then.

    Raises:
        CompletionRequestError: ``model`` is not a string.
        ModelNotFoundError: ``model`` is none of the ``served`` names.
    """
    model = body.get("model")
    if model is None:
        return served[0]
    if not isinstance(model, str):
        raise CompletionRequestError(f"'model' must be a string, got {model!r}", "model")
    if model not in served:
        raise ModelNotFoundError(
            f"The model `{model}` does not exist. This worker serves: {', '.join(served)}",
            "model",
        )
    return model


def model_request(
    raw: bytes, read: frozenset[str], served: Sequence[str]
) -> tuple[dict[str, Any], str]:
    """A request body for one of the ``served`` models: decoded, its parameters checked
    against those the endpoint ``read``s (see :func:`check_parameters`); and the model it
    asks for (see :func:`served_model`).

    Raises:
        CompletionRequestError: The body is not a JSON object, or has a parameter refused.
        ModelNotFoundError: ``model`` is none of the ``served`` names.
    """
    body = decode_body(raw)
    check_parameters(body, read)
    return body, served_model(body, served)


def int_field(body: Mapping[str, Any], name: str, default: int) -> int:
    """``body[name]`` as an integer (``default`` when absent or ``null``).

    Raises:
        CompletionRequestError: Not an integer (``true`` is no integer).
    """
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise CompletionRequestError(f"{name!r} must be an integer, got {value!r}", name)
    return value


def float_field(body: Mapping[str, Any], name: str, default: float) -> float:
    """``body[name]`` as a float (``default`` when absent or ``null``).

    Raises:
        CompletionRequestError: Not a number, or an integer beyond float range.
    """
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CompletionRequestError(f"{name!r} must be a number, got {value!r}", name)
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range, e.g. 10**400
        digits = len(str(abs(value)))
        raise CompletionRequestError(
            f"{name!r} is out of range: got an integer of {digits} digits", name
        ) from None


def bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """``body[name]`` as a boolean (``default`` when absent or ``null``).

    Raises:
        CompletionRequestError: Not ``true`` or ``false``.
    """
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CompletionRequestError(f"{name!r} must be true or false, got {value!r}", name)
    return value
