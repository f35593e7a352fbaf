"""Small shared test helpers."""

from kvpolicy.keys import Namespace

SECRET = bytes(range(32))


def ns(**kw) -> Namespace:
    base = dict(model_id="llama-3-8b", model_revision="r1", tokenizer_version="t1", kv_dtype="bf16", block_size_tokens=4)
    base.update(kw)
    return Namespace(**base)


class TimeRecorder:
    """A publish filter that publishes nothing and remembers the time_s of every request it observes."""

    def __init__(self):
        self.times = []

    def observe(self, request, keys):
        self.times.append(request.time_s)

    def publishable(self, request, keys):
        return 0


def race(*bodies) -> list[str]:
    """Run each body in its own thread, all at once, switching threads as often as the interpreter can (a race shows
    within a second), and return what they raised — repr()s, in the order raised — plus anything Python swallowed
    (an exception in a finalizer or a weakref callback goes to sys.unraisablehook, not to its thread)."""
    import sys
    import threading

    errors: list[str] = []

    def guarded(body):
        def run():
            try:
                body()
            except Exception as e:  # noqa: BLE001 - what the engine's thread would have died of
                errors.append(repr(e))
        return threading.Thread(target=run)

    threads = [guarded(b) for b in bodies]
    old_switch, old_hook = sys.getswitchinterval(), sys.unraisablehook
    sys.unraisablehook = lambda u: errors.append(repr(u.exc_value))
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_switch)
        sys.unraisablehook = old_hook
    return errors
