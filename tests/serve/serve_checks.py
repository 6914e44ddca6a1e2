"""What every error answer must be: the status asked for, and OpenAI's body (a message naming the fix)."""

from __future__ import annotations

from typing import Any

ERROR_FIELDS = {"message", "type", "param", "code"}


def openai_error(body: Any) -> dict[str, Any]:
    """The `error` object of an OpenAI error body; AssertionError if the body is not one."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def anthropic_error(body: Any) -> dict[str, Any]:
    """The `error` object of an Anthropic error body (`/v1/messages`); AssertionError if the body is not one."""
    assert isinstance(body, dict) and body.get("type") == "error" and set(body) == {"type", "error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    return error


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    return openai_error(response.json())
