"""Errors a user or plugin author sees. Each message names the problem and the fix."""

from __future__ import annotations


class InferError(Exception):
    """Base class: the CLI prints the message on one line and exits with code 2."""

    exit_code = 2


class ConfigError(InferError):
    """A flag, option or parameter value is out of range or inconsistent."""


class PluginNotFoundError(InferError):
    """A strategy name is not registered in its slot."""


class PluginLoadError(InferError):
    """A plugin that was asked for failed to import or register."""


class IncompatiblePluginsError(InferError):
    """Strategies that cannot run together (or on this device) were asked for."""


class ModelLoadError(InferError):
    """A model folder, weight file or tokenizer is missing or unreadable."""


def one_line(exc: BaseException | str) -> str:
    """A message on one line (a library's may span several), for an error line or a message of ours to quote."""
    return " ".join(str(exc).split())


class DatasetError(InferError):
    """A prompt file or workload cannot be read."""


class RequestError(InferError):
    """A single request is invalid (empty prompt, too long, bad sampling parameters)."""


class WorkerError(InferError):
    """A tensor-parallel rank failed or vanished; rank 0 stopped the run."""

    exit_code = 1
