"""tools/mutation.py's reach into subprocesses (issue #60): a test that starts ``python -m kvpolicy ...`` or
``python -c ...`` runs kvpolicy's code in another interpreter, which neither the parent's coverage nor a mutant swapped
into the parent's live functions can see. tools/mutation.py puts this directory first on ``PYTHONPATH``, so every
Python started beneath a test imports this file at startup and:

- ``KVPOLICY_MUTATION_COV=<dir>``: records coverage of the files in ``KVPOLICY_MUTATION_FILES`` (os.pathsep-separated)
  under the context ``KVPOLICY_MUTATION_CONTEXT`` (the test that started it), saved to ``<dir>`` at exit;
- ``KVPOLICY_MUTANT=<path>:<index>``: installs that mutant before any user code runs, as the parent did.

Then the interpreter's own ``sitecustomize`` (Debian's, say), which this one shadows, is run as it would have been.
"""

import os
import sys


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as f:
                code = compile(f.read(), candidate, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": candidate})  # noqa: S102 - the interpreter's own hook
            return


def _start() -> None:
    cov_dir = os.environ.get("KVPOLICY_MUTATION_COV")
    mutant = os.environ.get("KVPOLICY_MUTANT")
    if not cov_dir and not mutant:
        return
    tools = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if cov_dir:
        import atexit
        import uuid

        import coverage

        files = [f for f in os.environ.get("KVPOLICY_MUTATION_FILES", "").split(os.pathsep) if f]
        cov = coverage.Coverage(data_file=os.path.join(cov_dir, f"cov.{os.getpid()}.{uuid.uuid4().hex[:8]}"), include=files,
                                branch=False, context=os.environ.get("KVPOLICY_MUTATION_CONTEXT") or None)
        cov.start()

        def _save() -> None:
            cov.stop()
            cov.save()

        atexit.register(_save)
    if mutant:
        import importlib.util

        spec = importlib.util.spec_from_file_location("kvpolicy_mutation_tool", os.path.join(tools, "mutation.py"))
        assert spec is not None and spec.loader is not None
        tool = importlib.util.module_from_spec(spec)
        sys.modules["kvpolicy_mutation_tool"] = tool
        spec.loader.exec_module(tool)
        path, _, index = mutant.rpartition(":")
        tool.install_by_index(path, int(index))


_start()
_run_shadowed()
