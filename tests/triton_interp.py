"""Running Triton kernels in tests: on CUDA as they are, without it in Triton's interpreter on the CPU."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_MODULES = ("kernels.lora_shrink", "kernels.lora_expand", "kernels.lora_segments", "kernels.paged_attention", "kernels.rms_norm",
                  "kernels.rope_cache", "kernels.silu_mul", "kernels.decode_linear")


def import_kernels(*names: str) -> list[ModuleType]:
    """Import kernel modules; without CUDA, so that their kernels run in the Triton interpreter on the CPU.

    Triton reads TRITON_INTERPRET when @triton.jit decorates a function (triton.knobs.runtime.interpret), its
    own library (tl.zeros, tl.sum, ...) included, so the variable must be set when triton itself is first
    imported; if another test imported triton without it, triton's Python modules (not its compiled core) and
    the kernel modules that use triton are imported again. The variable is restored at once; `interpreter_env` sets it again
    while this module's tests run (triton imports more lazily at the first launch), and for no other test.
    """
    if DEVICE.type == "cuda":
        return [importlib.import_module(name) for name in names]
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        standard = sys.modules.get("triton.language.standard")
        if standard is not None and type(standard.sum).__name__ != "InterpretedFunction":
            stale = [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]
            stale += [m for m in sys.modules if m.startswith("kernels.") and hasattr(sys.modules[m], "triton")]
            for name in stale:
                del sys.modules[name]
        modules = [importlib.import_module(name) for name in names]
        _patch_lang_once_per_launch()
        return modules
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(scope="module", autouse=True)
def interpreter_env():
    """TRITON_INTERPRET=1 while the importing module's tests run without CUDA, and only then (see `import_kernels`).
    A test module imports this fixture to make it autouse there."""
    if DEVICE.type == "cuda":
        yield
        return
    import_kernels(*KERNEL_MODULES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _patch_lang_once_per_launch() -> None:
    """Patch triton.language once per launch for each language module, not at every @triton.jit call inside it.

    The interpreter patches the builtins of the language modules a function's globals hold (tl, tl.core:
    inspect.getmembers over each, ~4 ms) when a launch starts, and again at every device-function call: each call of
    `group_rows` (kernels/utils.py, once per program of the shrink and the expand) and of triton's own jit helpers
    (tl.zeros, whose module holds tl.core, which a kernel's own globals may not). Those were 48 of the 295 s of
    tests/test_cuda_graph.py's full-batch test. A call inside a launch whose modules that launch has already patched
    now adds nothing; any other call patches as before (the nested patches were never restored, so none is lost).
    Applied only when the interpreter has the names it wraps, once per import of triton.
    """
    from triton.runtime import interpreter

    original, run = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    if original is None or run is None or getattr(run, "_once_per_launch", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    tl = interpreter.tl
    state = {"launch": False, "patched": set()}  # the language modules patched in the running launch

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}  # as the interpreter picks them
        if state["launch"] and langs <= state["patched"]:
            return interpreter._LangPatchScope()  # this launch's patches are in place; nothing to restore
        scope = original(fn)
        if state["launch"]:
            state["patched"] |= langs
        return scope

    def launch(self, *args, **kwargs):
        state.update(launch=True, patched=set())
        try:
            return run(self, *args, **kwargs)
        finally:
            state.update(launch=False, patched=set())

    launch._once_per_launch = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
