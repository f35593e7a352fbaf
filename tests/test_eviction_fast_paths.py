"""The eviction base's fast paths leave what the plain calls leave (issue #48: the simulator made faster with every
decision unchanged). ``insert_pinned(k, s, p)`` is, by definition, ``on_insert(k, s, p)`` then ``pin(k)``; a
PriorityPolicy skips the instant in which the new block is a candidate. ``place_pinned`` is ``victims``, ``admit``,
``insert_pinned``, and a PriorityPolicy runs its eviction loop inline. Differential: the same operations on a policy
taking the fast path and on one made to take the plain calls give the same victims, the same pins and the same bytes."""

import pytest
from hypothesis import given, settings, strategies as st

from kvpolicy.clock import ManualClock
from kvpolicy.errors import CapacityError, ConfigError
from kvpolicy.eviction import ALL_POLICIES, make_policy
from kvpolicy.eviction.base import EvictionPolicy, PriorityPolicy

NEEDS_ORACLE = ("belady", "belady-bypass")
POLICIES = [p for p in ALL_POLICIES if p not in NEEDS_ORACLE]

# ops over 4 chains of up to 6 blocks: key = chain * 10 + depth, parent = the key one shallower
OPS = st.lists(st.tuples(st.sampled_from(["insert", "access", "unpin", "tick"]), st.integers(0, 3), st.integers(0, 5)), max_size=80)


class _Plain:
    """Forces the plain path: on_insert then pin."""

    def __init__(self, policy):
        self.p = policy

    def insert_pinned(self, key, size, parent):
        self.p.on_insert(key, size, parent)
        self.p.pin(key)


def _drive(policy, ops, plain, place=False):
    clock = policy.clock
    out = []
    ins = _Plain(policy).insert_pinned if plain else policy.insert_pinned
    for op, chain, depth in ops:
        key = chain * 10 + depth
        parent = key - 1 if depth else None
        clock.advance(0.25)
        if op == "insert" and key not in policy.nodes and (parent is None or parent in policy.nodes):
            if place:  # the fused path: room, admission and the pinned insert in one call
                before = set(policy.nodes)
                ok = policy.place_pinned(key, 8, parent)
                gone = tuple(sorted(k for k in before if k not in policy.nodes))
                out.append(("evict", gone) if ok or gone else ("full",))
                if ok:
                    out.append(("in", key))
                continue
            try:
                out.append(("evict", tuple(sorted(policy.victims(8, key)))))
            except CapacityError:
                out.append(("full",))
                continue
            if policy.admit(key, 8, parent):
                ins(key, 8, parent)
                out.append(("in", key))
        elif op == "access" and key in policy.nodes:
            policy.on_access(key)
        elif op == "unpin" and key in policy.nodes and policy.nodes[key].pins:
            policy.unpin(key)
    policy.check()
    state = sorted((k, n.pins, n.prot, n.children) for k, n in policy.nodes.items())
    return out, state, policy.used_bytes, policy.protected_bytes, policy.evictions


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS, cap_blocks=st.integers(2, 9))
def test_insert_pinned_leaves_what_insert_then_pin_leaves(name, ops, cap_blocks):
    fast = make_policy(name, cap_blocks * 8, clock=ManualClock())
    plain = make_policy(name, cap_blocks * 8, clock=ManualClock())
    assert _drive(fast, ops, plain=False) == _drive(plain, ops, plain=True)


def test_the_fast_path_is_taken_only_where_it_is_exact():
    """A PriorityPolicy of the library's takes it; a subclass that overrides on_insert, pin or _candidate does not (its
    override would be skipped)."""
    assert make_policy("lru", 64)._fused_pinned_insert and make_policy("reuse-distance", 64)._fused_pinned_insert
    seen = []

    class Counting(PriorityPolicy):
        def priority(self, node):
            return (node.t_access,)

        def _candidate(self, node, yes):
            seen.append((node.key, yes))
            super()._candidate(node, yes)

    c = Counting(64)
    assert not c._fused_pinned_insert
    c.insert_pinned("a", 8)
    assert seen == [("a", True), ("a", False)] and c.nodes["a"].pins == 1
    assert EvictionPolicy.insert_pinned is not PriorityPolicy.insert_pinned


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS, cap_blocks=st.integers(2, 9))
def test_place_pinned_leaves_what_victims_admit_insert_then_pin_leave(name, ops, cap_blocks):
    fast = make_policy(name, cap_blocks * 8, clock=ManualClock())
    plain = make_policy(name, cap_blocks * 8, clock=ManualClock())
    assert _drive(fast, ops, plain=False, place=True) == _drive(plain, ops, plain=True)


@pytest.mark.parametrize("name", POLICIES)
def test_place_pinned_uses_every_freeable_byte_when_that_is_exactly_enough(name):
    """The edge the general test rarely draws: the room needed equals the unpinned bytes exactly — it is made."""
    p = make_policy(name, 16, clock=ManualClock())
    assert p.place_pinned("a", 8) and p.place_pinned("b", 8)
    p.unpin("b")
    assert p.freeable_bytes == 8
    assert p.place_pinned("c", 8), "8 bytes needed, 8 freeable"
    assert "b" not in p.nodes and "c" in p.nodes and p.nodes["c"].pins == 1
    assert not p.place_pinned("d", 8), "all pinned: no room, nothing evicted"
    assert set(p.nodes) == {"a", "c"}
    p.check()


def _drive_in_order(policy, ops):
    """The victims in the order they are chosen; the clock moves only on "tick", so blocks inserted in one instant tie
    on time and their depth decides."""
    out = []
    for op, chain, depth in ops:
        key = chain * 10 + depth
        parent = key - 1 if depth else None
        if op == "tick":
            policy.clock.advance(0.25)
        elif op == "insert" and key not in policy.nodes and (parent is None or parent in policy.nodes):
            try:
                out.append(tuple(policy.victims(8, key)))
            except CapacityError:
                out.append(("full",))
                continue
            policy.insert_pinned(key, 8, parent)
        elif op == "access" and key in policy.nodes:
            policy.on_access(key)
        elif op == "unpin" and key in policy.nodes and policy.nodes[key].pins:
            policy.unpin(key)
    policy.check()
    return out, sorted(policy.nodes)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, cap_blocks=st.integers(2, 9))
def test_reuse_distance_flat_heap_entries_evict_what_nested_ones_evict(ops, cap_blocks):
    """reuse-distance flattens its priority into the heap entry; a subclass with the same priority (which takes the
    base's nested entries) must evict the same blocks in the same order."""
    from kvpolicy.eviction.reuse_distance import ReuseDistancePolicy

    class Nested(ReuseDistancePolicy):
        def priority(self, node):
            return super().priority(node)

    flat = ReuseDistancePolicy(cap_blocks * 8, clock=ManualClock())
    nested = Nested(cap_blocks * 8, clock=ManualClock())
    assert _drive_in_order(flat, ops) == _drive_in_order(nested, ops)
    assert all(len(e) == 6 for e in flat._heap) and all(len(e) == 4 for e in nested._heap)


def test_reuse_distance_breaks_a_tie_in_time_by_depth_deepest_first():
    """Two chains inserted in one instant and released: the deeper block goes first (the edge the property draws
    only now and then)."""
    from kvpolicy.eviction.reuse_distance import ReuseDistancePolicy

    p = ReuseDistancePolicy(3 * 8, clock=ManualClock())
    for key, parent in (("a", None), ("b", None), ("b1", "b")):
        p.insert_pinned(key, 8, parent)
    for key in ("a", "b", "b1"):
        p.unpin(key)
    assert p.victims(16) == ["b1", "a"]


# chain ops: ("chain", c, d) places chain c's blocks d .. 5 in one call; the others as above
CHAIN_OPS = st.lists(st.tuples(st.sampled_from(["chain", "access", "unpin", "tick"]), st.integers(0, 3), st.integers(0, 5)), max_size=60)


def _drive_chains(policy, ops, one_by_one):
    out = []
    for op, chain, depth in ops:
        keys = [chain * 10 + d for d in range(6)]
        if op == "tick":
            policy.clock.advance(0.25)
        elif op == "chain":
            before = set(policy.nodes)
            if one_by_one:  # what place_pinned_chain stands for
                j = depth
                while j < 6 and keys[j] not in policy.nodes and (j == 0 or keys[j - 1] in policy.nodes) \
                        and policy.place_pinned(keys[j], 8, keys[j - 1] if j else None):
                    j += 1
            else:
                j = policy.place_pinned_chain(keys, depth, 6, 8)
            out.append((j, tuple(sorted(k for k in before if k not in policy.nodes))))
        elif op == "access" and keys[depth] in policy.nodes:
            policy.on_access(keys[depth])
        elif op == "unpin" and keys[depth] in policy.nodes and policy.nodes[keys[depth]].pins:
            policy.unpin(keys[depth])
    policy.check()
    state = sorted((k, n.pins, n.prot, n.children, n.seq) for k, n in policy.nodes.items())
    numbers = {k: v for k, v in vars(policy).items() if type(v) in (int, float)}  # counts, GDSF's L, reuse-distance's V and W
    return out, state, numbers


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=CHAIN_OPS, cap_blocks=st.integers(2, 9))
def test_place_pinned_chain_leaves_what_place_pinned_block_by_block_leaves(name, ops, cap_blocks):
    """place_pinned_chain(keys, start, end, size) is place_pinned of each block under the one before it, stopping at a
    resident key, a missing parent, no room or a refusal; a PriorityPolicy runs it inline (every victim, pin, count and
    insertion order the same)."""
    chained = make_policy(name, cap_blocks * 8, clock=ManualClock())
    plain = make_policy(name, cap_blocks * 8, clock=ManualClock())
    assert _drive_chains(chained, ops, one_by_one=False) == _drive_chains(plain, ops, one_by_one=True)


def test_place_pinned_chain_stops_where_it_must():
    for name in ("lru", "reuse-distance", "sieve"):
        p = make_policy(name, 3 * 8, clock=ManualClock())
        assert p.place_pinned_chain(["a", "b", "c", "d"], 0, 4, 8) == 3, "room for 3, all pinned"
        assert set(p.nodes) == {"a", "b", "c"} and all(n.pins == 1 for n in p.nodes.values())
        assert p.place_pinned_chain(["a", "b"], 1, 2, 8) == 1, "b is resident"
        assert p.place_pinned_chain(["x", "y"], 1, 2, 8) == 1, "y's parent x is not resident"
        for k in ("c", "b"):
            p.unpin(k)
        assert p.place_pinned_chain(["a", "e", "f"], 1, 3, 8) == 3, "c and b make room for e and f under a"
        assert set(p.nodes) == {"a", "e", "f"} and p.nodes["f"].parent is p.nodes["e"]
        p.check()


def test_a_subclass_overriding_a_step_of_the_chain_takes_the_plain_path():
    calls = []

    class Counting(PriorityPolicy):
        def priority(self, node):
            return (node.t_access,)

        def place_pinned(self, key, size, parent=None):
            calls.append(key)
            return super().place_pinned(key, size, parent)

    c = Counting(64)
    assert not c._fused_chain and make_policy("reuse-distance", 64)._fused_chain
    assert c.place_pinned_chain(["a", "b"], 0, 2, 8) == 2 and calls == ["a", "b"]


def _drive_releases(policy, ops, one_by_one):
    """Chains placed and released: "release" unpins chain c's blocks from depth d on, root first (as a request lets go
    of what it held), with unpin_all or unpin by unpin."""
    out = []
    for op, chain, depth in ops:
        keys = [chain * 10 + d for d in range(6)]
        if op == "tick":
            policy.clock.advance(0.25)
        elif op == "chain":
            j = policy.place_pinned_chain(keys, depth, 6, 8)
            out.append(("placed", j))
        elif op == "access" and keys[depth] in policy.nodes:
            policy.on_access(keys[depth])
        elif op == "unpin":  # release
            held = [k for k in keys[depth:] if k in policy.nodes and policy.nodes[k].pins]
            if one_by_one:
                for k in held:
                    policy.unpin(k)
            else:
                policy.unpin_all(held)
            out.append(("released", len(held), tuple(n.key for n, _ in zip(policy._peek_order() or (), range(4)))))
    policy.check()
    state = sorted((k, n.pins, n.prot, n.children) for k, n in policy.nodes.items())
    numbers = {k: v for k, v in vars(policy).items() if type(v) in (int, float)}
    return out, state, numbers


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=100, deadline=None)
@given(ops=CHAIN_OPS, cap_blocks=st.integers(2, 9))
def test_unpin_all_leaves_what_unpin_by_unpin_leaves(name, ops, cap_blocks):
    fused = make_policy(name, cap_blocks * 8, clock=ManualClock())
    plain = make_policy(name, cap_blocks * 8, clock=ManualClock())
    assert _drive_releases(fused, ops, one_by_one=False) == _drive_releases(plain, ops, one_by_one=True)


@pytest.mark.parametrize("name", ["lru", "reuse-distance", "sieve"])
def test_unpin_all_stops_at_a_key_that_is_not_pinned(name):
    p = make_policy(name, 64, clock=ManualClock())
    p.place_pinned_chain(["a", "b"], 0, 2, 8)
    with pytest.raises(ConfigError, match="'zz' is not pinned"):
        p.unpin_all(["a", "zz", "b"])
    assert p.nodes["a"].pins == 0 and p.nodes["b"].pins == 1, "the keys before it are released, the ones after are not"
    p.check()
    p.pin("b")
    p.unpin_all(["b"])
    assert p.nodes["b"].pins == 1 and p.freeable_bytes == 0, "pinned twice, released once: still held, and its parent"
    p.check()


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("chained", [False, True])
def test_a_parent_is_never_evicted_to_make_room_for_its_own_child(name, chained):
    """Placing c under an unpinned b: b (and a above it) are held while room is made, so room comes from elsewhere or
    not at all — never a ConfigError after evicting the parent, never a dangling child."""
    def place(p, keys, start):
        if chained:
            return p.place_pinned_chain(keys, start, len(keys), 8) == len(keys)
        return p.place_pinned(keys[start], 8, keys[start - 1])

    p = make_policy(name, 2 * 8, clock=ManualClock())
    assert p.place_pinned_chain(["a", "b"], 0, 2, 8) == 2
    p.unpin_all(["a", "b"])
    assert not place(p, ["a", "b", "c"], 2), "the only room is the parent's chain"
    assert set(p.nodes) == {"a", "b"} and p.freeable_bytes == 16, "nothing changed, nothing left held"
    p.check()

    p = make_policy(name, 3 * 8, clock=ManualClock())
    assert p.place_pinned_chain(["x"], 0, 1, 8) == 1 and p.place_pinned_chain(["a", "b"], 0, 2, 8) == 2
    p.unpin_all(["x", "a", "b"])
    if place(p, ["a", "b", "c"], 2):  # a policy may also refuse (admit)
        assert set(p.nodes) == {"a", "b", "c"} and p.nodes["c"].pins == 1 and p.nodes["b"].pins == 0
    p.check()


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("how", ["place_pinned", "place_pinned_chain"])
def test_the_fast_paths_evict_a_full_cache_of_candidates_in_the_plain_order(name, how):
    """Many candidates at once, the case random ops rarely build: six unpinned blocks (two chains and two roots, used
    at different times), then six placements — each evicts one, in the order victims() would take them."""
    def fill(p):
        for keys in (["a", "a1"], ["b"], ["c", "c1"], ["d"]):
            p.clock.advance(1.0)
            assert p.place_pinned_chain(keys, 0, len(keys), 8) == len(keys)
        for k in ("c", "a", "b", "a1", "d", "c1"):
            p.unpin(k)
        p.clock.advance(1.0)
        p.on_access("b")

    fast, plain = (make_policy(name, 6 * 8, clock=ManualClock()) for _ in range(2))
    fill(fast)
    fill(plain)
    got, want = [], []
    for i in range(6):
        fast.clock.advance(1.0)
        plain.clock.advance(1.0)
        before = set(fast.nodes)
        if how == "place_pinned":
            assert fast.place_pinned(f"n{i}", 8)
        else:
            assert fast.place_pinned_chain([f"n{i}"], 0, 1, 8) == 1
        got.append(tuple(sorted(before - set(fast.nodes))))
        want.append(tuple(plain.victims(8, f"n{i}")))
        plain.insert_pinned(f"n{i}", 8)
    assert got == want
    fast.check()


def test_the_inline_chain_and_eviction_loop_keep_a_subclass_s_own_prot_up_and_forget():
    """place_pinned_chain writes the parent's _prot_up inline (it stops at the parent's own count), so a subclass with
    its own _prot_up takes the plain path; the inline eviction loop skips the base's no-op _forget but calls a
    subclass's for every victim, in eviction order."""
    ups, forgotten = [], []

    class OwnProtUp(PriorityPolicy):
        def priority(self, node):
            return (node.t_access,)

        def _prot_up(self, node):
            ups.append(node.key)
            super()._prot_up(node)

    class OwnForget(PriorityPolicy):
        def priority(self, node):
            return (node.seq,)

        def _forget(self, node):
            forgotten.append(node.key)

    p = OwnProtUp(64)
    assert not p._fused_chain
    assert p.place_pinned_chain(["a", "b", "c"], 0, 3, 8) == 3 and ups == ["a", "b"]
    f = OwnForget(3 * 8)
    assert f._fused_chain and f._forgets and not make_policy("reuse-distance", 64)._forgets
    assert f.place_pinned_chain(["a", "b", "c"], 0, 3, 8) == 3
    f.unpin_all(["a", "b", "c"])
    assert f.place_pinned_chain(["x", "y"], 0, 2, 8) == 2 and forgotten == ["c", "b"]
    f.check()


# chain ops over a cache that also holds lone blocks of other sizes: ("lone", size, i) makes room for and inserts lone
# block 100 + i of 4, 8 or 12 bytes (unpinned), so the victims a chain needs are of mixed sizes; ("release", c, d) unpins
# chain c's blocks from depth d on (a request done with them), so whole chains turn evictable, leaf first
MIXED_OPS = st.lists(st.one_of(st.tuples(st.sampled_from(["chain", "access", "release", "tick"]), st.integers(0, 3), st.integers(0, 5)),
                               st.tuples(st.just("lone"), st.sampled_from([4, 8, 12]), st.integers(0, 7))), max_size=60)


@pytest.mark.parametrize("name", [n for n in POLICIES if isinstance(make_policy(n, 64), PriorityPolicy)])  # (the others: one size)
@settings(max_examples=150, deadline=None)
@given(ops=MIXED_OPS, cap_blocks=st.integers(2, 9), extra=st.integers(0, 7))
def test_a_chain_placed_at_once_evicts_what_block_by_block_evicts_among_victims_of_mixed_sizes(name, ops, cap_blocks, extra):
    """place_pinned_chain making room for the whole run in one eviction pass (a PriorityPolicy whose admission moves no
    priority), taking a parent that turns candidate as the next victim without a push when it sorts first, evicts the
    same victims, in the same order, as the plain path (the base's place_pinned: victims(), admit, insert_pinned) block
    by block — also when the victims' sizes differ from the blocks' and a victim frees more than one block's room."""
    runs = []
    for one_by_one in (False, True):
        policy = make_policy(name, cap_blocks * 8 + extra, clock=ManualClock())
        order: list = []
        forget = policy._forget

        def watch(node, forget=forget, order=order):
            order.append(node.key)
            forget(node)

        policy._forget = watch  # on the instance: the class's flags (fused paths) stay as they are
        policy._forgets = True
        out = []
        for op, a, b in ops:
            if op == "lone":
                key = 100 + b
                if key not in policy.nodes:
                    try:
                        policy.victims(a, key)
                    except CapacityError:
                        continue
                    if policy.admit(key, a):
                        policy.on_insert(key, a)
                continue
            keys = [a * 10 + d for d in range(6)]
            if op == "tick":
                policy.clock.advance(0.25)
            elif op == "chain":  # from depth b, or from the chain's first block not resident when that is shallower
                b = min(b, next((d for d, k in enumerate(keys) if k not in policy.nodes), 6))
                if one_by_one:  # the plain path: the base's place_pinned (victims(), admit, insert_pinned) per block
                    j = b
                    while j < 6 and keys[j] not in policy.nodes and (j == 0 or keys[j - 1] in policy.nodes) \
                            and EvictionPolicy.place_pinned(policy, keys[j], 8, keys[j - 1] if j else None):
                        j += 1
                else:
                    j = policy.place_pinned_chain(keys, b, 6, 8)
                out.append(j)
            elif op == "access" and keys[b] in policy.nodes:
                policy.on_access(keys[b])
            elif op == "release":  # a request letting go of the chain's blocks from depth b on, root first
                for k in keys[b:]:
                    if k in policy.nodes and policy.nodes[k].pins:
                        policy.unpin(k)
        policy.check()
        numbers = {k: v for k, v in vars(policy).items() if type(v) in (int, float)}
        runs.append((out, order, sorted((k, n.pins, n.prot, n.children, n.seq) for k, n in policy.nodes.items()), numbers))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["lru", "reuse-distance"])
def test_a_parent_turning_candidate_is_taken_next_only_when_it_sorts_first_and_pushed_when_room_is_made(name):
    """Two hand-worked cases of the eviction loop's direct parent, each against the plain path (the base's
    place_pinned, block by block): a parent used after another candidate waits its turn behind it; a grandparent that
    turns candidate as the last victim goes keeps its heap entry (evicted later, before a newer block)."""
    for plain in (False, True):
        p = make_policy(name, 4 * 8, clock=ManualClock())
        order: list = []
        p._forget = order.append  # on the instance: the class's flags stay
        p._forgets = True

        def place(keys):
            if plain:
                j = 0
                while j < len(keys) and EvictionPolicy.place_pinned(p, keys[j], 8, keys[j - 1] if j else None):
                    j += 1
                return j
            return p.place_pinned_chain(keys, 0, len(keys), 8)

        assert place(["a0", "a1", "a2"]) == 3
        p.unpin_all(["a0", "a1", "a2"])
        p.clock.advance(1.0)
        p.on_insert("x", 8)  # a lone block, used at t = 1
        p.clock.advance(1.0)
        p.on_access("a1")  # a1 used at t = 2: once a2 goes, a1 sorts after x
        assert place(["b0", "b1"]) == 2
        first = [n.key for n in order]
        p.unpin_all(["b0", "b1"])
        p.clock.advance(1.0)
        assert place(["c0"]) == 1  # one victim: a1 (LRU), whose parent a0 turns candidate as the room is made
        assert place(["d0"]) == 1  # a0 must still be found
        p.check()
        if plain:
            want = (first, [n.key for n in order])
        else:
            got = (first, [n.key for n in order])
    assert got == want
    if name == "lru":
        assert want == (["a2", "x"], ["a2", "x", "a1", "a0"]), "a1 (used at t = 2) waits behind x (t = 1); a0 kept its entry"
