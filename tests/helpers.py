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
