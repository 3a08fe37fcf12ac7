"""Checks on a REST request body before MLflow's scoring server parses it (``mlflow models serve``).

MLflow's scoring server parses a JSON body itself, before the model sees it:

- its ``json.loads`` recurses once per nesting level, so a body nested 100,000 deep raises
  ``RecursionError``, which the server answers with HTTP 500;
- it turns an invalid body into a 400 whose message quotes the whole body back;
- with the ``inputs`` format it builds a numpy array per field, so a ragged ``candidate_ids`` or
  ``dense`` fails inside MLflow with a generic 400 that names no field.

A models-from-code value model runs its loading code in the server process before the server is
built (``mlflow/pyfunc/scoring_server/app.py`` loads the model, then calls ``init``). So
:class:`gem.packaging.GemValueModel` calls :func:`install_request_guard` with its own request check:
the server's JSON entry point, ``mlflow.pyfunc.scoring_server._parse_json_data`` (looked up by name
at every request), is wrapped so that the body's nesting depth is measured without recursion, the
body is parsed, and the model's check runs on the parsed payload; a failure raises
``MlflowException(INVALID_PARAMETER_VALUE)``, an HTTP 400 whose one-line message names the field.
The original entry point then parses as before. Should an MLflow release rename that entry point,
the guard logs a warning and is not installed; the model still validates every request it gets.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from mlflow.exceptions import MlflowException

from foundation.messages import clip

MAX_DEPTH = 32
ENTRY_POINT = "_parse_json_data"
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_COMMA = ord(",")
# +1 for an opening bracket, -1 for a closing one, 0 for any other byte.
_STEP = np.zeros(256, np.int32)
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1
_logger = logging.getLogger(__name__)


def _structure(body: bytes) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """``(bytes[n] uint8, depth[n] after each byte, string spans)`` of a JSON text; brackets inside
    strings do not count."""
    data = np.frombuffer(body, np.uint8)
    spans = [m.span() for m in _STRING.finditer(body)]
    edges = np.zeros(len(data) + 1, np.int32)
    if spans:
        starts, ends = np.array(spans).T
        np.add.at(edges, starts, 1)
        np.add.at(edges, ends, -1)
    step = _STEP[data]
    if spans:
        step[np.cumsum(edges[:-1]) != 0] = 0
    return data, np.cumsum(step), spans


def _path_to(body: bytes, data: np.ndarray, depth: np.ndarray, spans: list[tuple[int, int]], at: int, levels: int) -> str:
    """``dataframe_records[0].candidate_ids[3]``-style path of the containers enclosing byte ``at``."""
    keys = [(s, e) for s, e in spans if s < at and body[e : e + 64].lstrip()[:1] == b":"]
    path = ""
    for level in range(1, levels + 1):
        opened = np.flatnonzero((depth[:at] == level) & (np.concatenate(([0], depth[: at - 1])) == level - 1))
        if not len(opened):
            break
        start = int(opened[-1])
        if data[start] == ord("["):
            commas = int(np.count_nonzero((data[start:at] == _COMMA) & (depth[start:at] == level)))
            path += f"[{commas}]"
        else:
            inner = [body[s + 1 : e - 1].decode(errors="replace") for s, e in keys if s > start and depth[s] == level]
            path += f".{clip(inner[-1], 40)}" if inner else ""
    return path.lstrip(".")


def nesting_error(body: bytes, limit: int = MAX_DEPTH) -> str | None:
    """A one-line reason when the JSON text ``body`` nests deeper than ``limit``, naming where; else None.

    Linear time, no recursion; a body with at most ``limit`` brackets in all is accepted at once.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    data, depth, spans = _structure(body)
    if depth.max(initial=0) <= limit:
        return None
    at = int(np.argmax(depth > limit))
    where = _path_to(body, data, depth, spans, at, levels=8) or "the top level"
    return f"request body nests deeper than {limit} levels (under {where}, at byte {at})"


def install_request_guard(check: Callable[[Any], None], *, max_depth: int = MAX_DEPTH) -> bool:
    """Wrap the scoring server's JSON entry point (module doc) so that every JSON body is depth-checked,
    parsed and passed to ``check`` (which raises ``ValueError`` naming the field) before MLflow parses it.

    Installing again replaces the check. Returns whether the guard is installed.
    """
    from mlflow.pyfunc import scoring_server

    current = getattr(scoring_server, ENTRY_POINT, None)
    if current is None:
        _logger.warning("mlflow.pyfunc.scoring_server.%s not found: REST bodies are not pre-checked", ENTRY_POINT)
        return False
    original = getattr(current, "__wrapped__", current)

    @functools.wraps(original)
    def guarded(data, *args, **kwargs):
        body = data.encode() if isinstance(data, str) else data
        if isinstance(body, bytes | bytearray):
            check_body(bytes(body), check, max_depth)
        return original(data, *args, **kwargs)

    setattr(scoring_server, ENTRY_POINT, guarded)
    return True


def check_body(body: bytes, check: Callable[[Any], None], max_depth: int = MAX_DEPTH) -> None:
    """Refuse ``body`` with ``MlflowException(INVALID_PARAMETER_VALUE)`` (HTTP 400) when it nests too deep,
    is not JSON, or fails ``check``; the message is one line naming the field."""
    if problem := nesting_error(body, max_depth):
        raise MlflowException.invalid_parameter_value(problem)
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MlflowException.invalid_parameter_value(f"request body is not valid JSON: {clip(str(exc))}") from None
    try:
        check(payload)
    except ValueError as exc:
        raise MlflowException.invalid_parameter_value(str(exc)) from None
