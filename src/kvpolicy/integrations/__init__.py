"""Thin adapters to engines' seams; each imports its engine (if at all) lazily.

* :mod:`kvpolicy.integrations.vllm_events` — vLLM KV events (msgpack over ZMQ) into the directory
* :mod:`kvpolicy.integrations.vllm_connector` — admission and publishing behind a vLLM KV connector
* :mod:`kvpolicy.integrations.sglang` — a kvpolicy eviction policy as SGLang's ``EvictionStrategy``
* :mod:`kvpolicy.integrations.sglang_bench` — which strategy to run in SGLang, on your trace (``kvpolicy sglang-bench``)
* :mod:`kvpolicy.integrations.lmcache` — a kvpolicy publish filter as an LMCache store policy
"""
