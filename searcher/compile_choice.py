"""Compile on or off, chosen by the cost model (`search(..., choose_compile=True)`).

`torch.compile` is a strategy key like recompute, but not one the candidates enumerate: it changes
which layouts run (tp through DTensor only eager, `capabilities.DTENSOR_COMPILE_PROBLEM`) and what a
stage keeps (`cost_models.compiled_stage`), so each way is searched whole over the same graph and
facts, and the plan predicted faster is kept. A tie keeps eager, which has nothing to compile. The
eager search's answer stands when neither finds a plan, and its errors (a fixed key that no
completion can take) are the user's; the compiled search's are a reason not to compile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from autopar.errors import AutoparError
from autopar.searcher.why_not import WhyNot, priced_row


@dataclass(frozen=True)
class CompileChoice:
    """What `search(..., choose_compile=True)` compared: each way's fastest predicted step that fits
    (None: none fits, or the way cannot run: `refusal` says why for the compiled way)."""

    compiled: bool
    eager_step_time_s: float | None
    compiled_step_time_s: float | None
    refusal: str | None = None

    def line(self) -> str:
        """One line for the user: what was chosen and on what numbers."""
        chosen = "on" if self.compiled else "off"
        if self.eager_step_time_s is not None and self.compiled_step_time_s is not None:
            return (f"compile {chosen}: predicted {self.compiled_step_time_s * 1e3:.4g} ms a step compiled, "
                    f"{self.eager_step_time_s * 1e3:.4g} ms eager")
        if self.eager_step_time_s is None and self.compiled_step_time_s is None:
            return f"neither the eager nor the compiled search found a plan (compiled: {self.refusal})"
        other = "eager" if self.compiled else "compiled"
        return f"compile {chosen}: the {other} search found no plan ({self.refusal})"


def search_choosing_compile(search: Callable[[dict[str, Any]], Any], fixed: dict[str, Any],
                            progress: Callable[[str], None] | None = None):
    """`search(fixed)` eager and compiled (`fixed` leaves `compile` free); the result of the faster,
    with `compile_choice` set, both searches' totals, and a why-not row for the other way."""
    say = progress or (lambda _message: None)
    say("searching the eager plan (then the compiled one; the faster predicted is kept)")
    eager = search(fixed)
    say("searching the compiled plan")
    try:
        compiled = search({**fixed, "compile": True})
        refusal = None if compiled.best is not None else _closest_text(compiled)
    except AutoparError as error:
        compiled, refusal = None, str(error)
    except Exception as error:  # a bug met only compiled must not cost the user the eager plan
        compiled, refusal = None, f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    times = {False: _fastest(eager), True: _fastest(compiled) if compiled is not None else None}
    found = [way for way, time_s in times.items() if time_s is not None]
    chosen = min(found, key=lambda way: (times[way], way)) if found else False
    if chosen and eager.best is None:
        refusal = _closest_text(eager)
    choice = CompileChoice(chosen, times[False], times[True], refusal if len(found) < 2 else None)
    kept, other = (compiled, eager) if chosen else (eager, compiled)
    label = "compiled (compile=true)" if not chosen else "eager (compile=false)"
    if len(found) == 2:
        row = priced_row(label, other.best.evaluation, kept.best.evaluation)
    else:
        closest = other.ranked[0].evaluation if other is not None and other.ranked else None
        row = WhyNot(label, closest.strategy if closest else None, f"found no plan: {refusal}",
                     fits=False if closest else None, peak_memory_bytes=closest.peak_memory_bytes if closest else None)
    totals = {} if other is None else dict(
        candidates=kept.candidates + other.candidates, search_s=kept.search_s + other.search_s,
        rejected={**other.rejected, **kept.rejected}, ilp_variables=kept.ilp_variables + other.ilp_variables,
        ilp_solve_s=kept.ilp_solve_s + other.ilp_solve_s)
    return dataclasses.replace(kept, why_not=[row, *kept.why_not], compile_choice=choice, **totals)


def _fastest(result) -> float | None:
    return result.best.evaluation.step_time_s if result.best is not None else None


def _closest_text(result) -> str:
    """Why a search found no plan, in the words of its closest candidate."""
    if not result.ranked:
        return "no valid strategy"
    closest = result.ranked[0].evaluation
    return (f"the closest needs {closest.peak_memory_bytes / 2**30:.1f} GiB per GPU of "
            f"{closest.capacity_bytes / 2**30:.1f} GiB usable")
