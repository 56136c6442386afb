"""Errors raised when a Ray actor of the run dies. Importable without Ray (the CLI catches them)."""

from __future__ import annotations

__all__ = ["RayActorDiedError", "EngineDiedError", "RayActorStartError"]


def _first_line(cause: BaseException | str | None) -> str:
    if cause is None:
        return ""
    if isinstance(cause, BaseException):
        text = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {text[0] if text else ''}"
    return str(cause)


class RayActorDiedError(RuntimeError):
    """A Ray actor of this run (engine, reference, critic, reward, policy rank) died or became unreachable."""

    what = "Ray actor"

    def __init__(self, actor_id: str, during: str, cause: BaseException | str | None = None) -> None:
        self.actor_id, self.during, self.detail = actor_id, during, _first_line(cause)
        super().__init__(
            f"{self.what} {actor_id} died during {during}" + (f" ({self.detail})" if self.detail else "")
            + ". The run stopped; the last complete checkpoint is intact: rerun the same command with "
            "--ckpt.load_enable to resume from it."
        )

    def __reduce__(self):  # Ray pickles task errors: keep the fields, not just the message
        return type(self), (self.actor_id, self.during, self.detail or None)


class EngineDiedError(RayActorDiedError):
    """A rollout-engine actor died (killed, out of memory, node lost) mid-run."""

    what = "rollout engine actor"

    @property
    def engine_id(self) -> str:
        return self.actor_id


class RayActorStartError(RuntimeError):
    """An actor's constructor raised (bad model path, engine settings, out of memory at load)."""

    def __init__(self, actor_id: str, cause: str) -> None:
        self.actor_id, self.cause = actor_id, cause
        super().__init__(f"Ray actor {actor_id} failed to start: {cause}")

    def __reduce__(self):
        return type(self), (self.actor_id, self.cause)
