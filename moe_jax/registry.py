"""One way to choose among implementations of an op: by name, with reasons, and "auto".

Every op with several implementations (grouped GEMM, permute, unpermute, token quantization,
act + quantization, and their backward ops) keeps one `Registry`. An implementation is any object
with a `name` and an `unsupported_reason(problem) -> str | None` method; the problem is the op's
frozen dataclass of static facts (shapes, dtypes, platform).

Choosing, the same for every op:

- a name runs that implementation or raises `NoImplementationError` with its reason;
- an implementation object is used as given, after the same check;
- `"auto"` tries the op's preference for the problem, in order, and takes the first that runs;
  when all refuse, the error lists every reason.

Implementations in other modules (Pallas kernels, torch-hosted libraries) are listed by module
name and imported on first use, so one whose library is missing stays listed and says why; a
function implementation may also name its function by path (`lazy`), so that choosing it (or
refusing it, on a CPU) imports nothing. A registry holds what a user may pass: the kernels'
interpret-mode variants, CPU test vehicles, are registered by the tests.

Example:
  >>> import dataclasses
  >>> @dataclasses.dataclass(frozen=True)
  ... class Problem:
  ...     platform: str
  >>> @dataclasses.dataclass(frozen=True)
  ... class Impl:
  ...     name: str
  ...     platforms: tuple[str, ...]
  ...     def unsupported_reason(self, problem):
  ...         if problem.platform not in self.platforms:
  ...             return f"runs on {self.platforms}, not {problem.platform}"
  ...         return None
  >>> ops = Registry("demo op", preference=lambda problem: ("fast", "slow"))
  >>> _ = ops.register(Impl("fast", ("gpu",))), ops.register(Impl("slow", ("cpu", "gpu")))
  >>> ops.select("auto", Problem("cpu")).name
  'slow'
  >>> try:
  ...     ops.select("fast", Problem("cpu"))
  ... except NoImplementationError as error:
  ...     print(error.refusals)
  {'fast': "runs on ('gpu',), not cpu"}
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import jax

AUTO = "auto"


class Implementation(Protocol):
    """What a registry holds: a name and a reason to refuse a problem (None: it runs)."""

    name: str

    def unsupported_reason(self, problem: Any) -> str | None: ...


ImplT = TypeVar("ImplT", bound=Implementation)


class NoImplementationError(NotImplementedError):
    """No implementation (of those asked for) runs the problem.

    Attributes:
      refusals: implementation name -> why it refused.
    """

    def __init__(self, op: str, problem: Any, refusals: Mapping[str, str]):
        self.refusals = dict(refusals)
        reasons = "; ".join(f"{name}: {why}" for name, why in self.refusals.items())
        super().__init__(f"no {op} implementation runs {problem}: {reasons}")


class Registry(Generic[ImplT]):
    """Implementations of one op by name, and the rule that picks one.

    Args:
      op: what the op is called in messages ("grouped GEMM", "permute", ...).
      preference: problem -> names in the order "auto" tries them. Names left out are never
        picked automatically but run when named.
      modules: name -> module that registers that implementation when imported.
    """

    def __init__(
        self,
        op: str,
        *,
        preference: Callable[[Any], Sequence[str]],
        modules: Mapping[str, str] | None = None,
    ):
        self.op = op
        self._preference = preference
        self._modules = dict(modules or {})
        self._impls: dict[str, ImplT] = {}

    def register(self, impl: ImplT) -> ImplT:
        """Adds `impl` under `impl.name`; a second registration under one name is an error."""
        name = getattr(impl, "name", "")
        if not name or name == AUTO:
            raise ValueError(f"{impl!r} needs a name other than {AUTO!r} to be registered")
        if name in self._impls and self._impls[name] is not impl:
            raise ValueError(f"a {self.op} implementation named {name!r} is already registered")
        self._impls[name] = impl
        return impl

    def names(self) -> tuple[str, ...]:
        """Every name `get` accepts (registered or importable), sorted."""
        return tuple(sorted(set(self._modules) | set(self._impls)))

    def get(self, name: str) -> ImplT:
        """The implementation registered as `name`, importing its module on first use."""
        if name not in self._impls and name in self._modules:
            importlib.import_module(self._modules[name])
        if name not in self._impls:
            raise ValueError(
                f"unknown {self.op} implementation {name!r}; choose from {[AUTO, *self.names()]}"
            )
        return self._impls[name]

    def preference(self, problem: Any) -> tuple[str, ...]:
        """The names "auto" tries for `problem`, in order."""
        return tuple(self._preference(problem))

    def first_accepting(self, names: Sequence[str], problem: Any) -> ImplT | None:
        """The first of `names` whose implementation accepts `problem`, or None where none does
        (an optional choice made from a preference other than the op's own, such as the fused
        GEMM1 `ContiguousExperts(fused_act_quant="auto")` may take)."""
        return _first_accepting((self.get(name) for name in names), problem)[0]

    def select(self, choice: str | ImplT, problem: Any) -> ImplT:
        """The implementation that runs `problem`: `choice` itself, or for "auto" the first in
        `preference(problem)` that accepts it.

        Raises:
          TypeError: `choice` is neither a name nor an implementation.
          ValueError: unknown name.
          NoImplementationError: the chosen (or every preferred) implementation refuses.
        """
        if isinstance(choice, str):
            names = self.preference(problem) if choice == AUTO else (choice,)
            candidates = [self.get(name) for name in names]
        elif callable(getattr(choice, "unsupported_reason", None)):
            candidates = [choice]
        else:
            raise TypeError(
                f"{self.op} implementation {choice!r}: pass {AUTO!r}, one of "
                f"{list(self.names())}, or an object with unsupported_reason()"
            )
        impl, refusals = _first_accepting(candidates, problem)
        if impl is None:
            raise NoImplementationError(self.op, problem, refusals)
        return impl

    def reasons(self, problem: Any) -> dict[str, str | None]:
        """name -> why it refuses `problem` (None where it runs), for every known implementation."""
        out = {}
        for name in self.names():
            try:
                out[name] = self.get(name).unsupported_reason(problem)
            except ImportError as error:
                out[name] = f"cannot be imported: {error}"
        return out


def _first_accepting(
    candidates: Iterable[ImplT], problem: Any
) -> tuple[ImplT | None, dict[str, str]]:
    """The registry's one acceptance loop: the first of `candidates` (taken in order, lazily)
    whose `unsupported_reason(problem)` is None, or None; and why each one before it refused."""
    refusals = {}
    for impl in candidates:
        why = impl.unsupported_reason(problem)
        if why is None:
            return impl, refusals
        refusals[impl.name] = why
    return None, refusals


def current_platform() -> str:
    """The platform the next computation runs on, as `jax.default_backend()` names platforms:
    that of `jax.default_device(...)` when one is set (a context manager or the config), else
    the default backend. "auto" decides with it, so a program that runs on the CPU devices of a
    GPU host (`with jax.default_device(jax.devices("cpu")[0]):`) gets CPU implementations."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpProblem:
    """Static facts that the data-movement and elementwise ops decide on.

    Used by permute, unpermute, token counting, `group_quant` and `act_and_quant`, whose
    implementations differ in where they run (and, for act + quant, which activations the
    compiled kernel lowers), not in shape limits.

    Attributes:
      platform: "cpu", "gpu", ... as `current_platform()` gives it.
      dtype: name of the main operand's dtype.
      activation: the gated activation, for act + quant; None elsewhere.
    """

    platform: str
    dtype: str
    activation: str | None = None


def pallas_then_xla(problem: OpProblem) -> tuple[str, ...]:
    """The preference of the Pallas-kernel ops: the compiled kernel on a GPU, else XLA
    (BENCHMARKS.md, Thresholds: "PERMUTES, UNPERMUTES `pallas_then_xla`")."""
    return ("pallas", "xla") if problem.platform == "gpu" else ("xla",)


def needs_gpu(problem: Any) -> str | None:
    """The refusal of a compiled Pallas Triton kernel: it runs on NVIDIA GPUs only."""
    if problem.platform != "gpu":
        return f"the compiled Pallas Triton kernel needs an NVIDIA GPU, not {problem.platform!r}"
    return None


def lazy(path: str) -> Callable[..., Any]:
    """The function at `path` ("package.module:function"), imported on its first call: a
    registry lists a kernel without importing it (or the Pallas backend it imports) until it runs.

    Example:
      >>> lazy("math:sqrt")(16.0)
      4.0
    """
    module, _, name = path.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = path
    return call


def _runs_anywhere(problem: Any) -> None:
    del problem


@dataclasses.dataclass(frozen=True)
class FunctionImpl:
    """An implementation that is one function plus its refusal rule.

    Attributes:
      name: registry name.
      fn: the function; calling the implementation calls it.
      refuse: problem -> reason it cannot run (None: it runs).
    """

    name: str
    fn: Callable[..., Any]
    refuse: Callable[[Any], str | None] = _runs_anywhere

    def unsupported_reason(self, problem: Any) -> str | None:
        return self.refuse(problem)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)
