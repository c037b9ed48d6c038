"""Checks of SGLang's state in SGLang's own terms; each failure is a ``Violation``.

They read an ``SglangScheduler`` (``kvprop.targets.sglang``): its tree cache, allocator, request
pool and live requests, as SGLang's own objects.

* ``check_conservation``: per pool, available + evictable + protected + what live requests hold
  outside the tree == the pool's size. This is the contract of SGLang's
  ``SchedulerInvariantChecker._check_pool_invariant`` as ``self_check_during_busy`` applies it
  (``managers/scheduler_components/invariant_checker.py``, 0.5.18 and 0.5.23: "available +
  evictable + protected + session_held + uncached == total", uncached from
  ``_get_total_uncached_sizes``), computed here from the live requests kvprop's glue tracks.
* ``check_totals``: the tree's running totals equal a recount from a walk of its nodes.
* ``check_lock_refs``: a node's lock count equals the live requests locked at or below it.
* ``check_slots_disjoint``: no full-pool KV slot is held twice (tree, requests' rows, free list).
* ``check_idle``: with every request ended, SGLang's own idle checks pass and every row is free.

The walks need a tree whose nodes Python can reach: ``RadixCache`` or ``UnifiedRadixCache`` on
its Python core. The Rust core of 0.5.19 on exposes no node walk (``node_by_id`` and
``root_node`` raise ``NotImplementedError``), so there ``check_all`` runs the checks that need
none: conservation, and the idle check.
"""

from __future__ import annotations

from kvprop.errors import Violation

FULL = 0  # ComponentType.FULL
SWA = 1  # ComponentType.SWA


def _components(tree) -> tuple | None:
    """The unified tree's component types, or None for ``RadixCache``."""
    return getattr(tree, "tree_components", None)


def tree_root(tree):
    """The root node Python can walk, or None (the Rust tree core)."""
    core = getattr(tree, "tree_core", None)
    if core is None:
        return tree.root_node
    try:
        return core.root_node
    except NotImplementedError:
        return None


def walkable(sched) -> bool:
    return tree_root(sched.tree_cache) is not None


def _nodes(tree) -> list:
    """Every non-root node, parents first."""
    out, stack = [], list(tree_root(tree).children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def node_value(tree, node, component: int = FULL):
    """A node's slots in ``component`` (full attention by default); None where it holds none."""
    return node.value if _components(tree) is None else node.component(component).value


def _lock_ref(tree, node, component: int = FULL) -> int:
    return node.lock_ref if _components(tree) is None else node.component(component).lock_ref


def _node(tree, handle):
    """A node from what a request holds: the node itself, or a NodeId (0.5.23)."""
    if isinstance(handle, int):
        return tree.tree_core.node_by_id(handle)
    return handle


def _private_full(sched, req) -> int:
    """Full-pool slots a live request holds outside the tree, in whole pages
    (``kv_private_tokens``: ``ceil_align(kv_allocated_len, page) - cache_protected_len``)."""
    page = sched.config.page_size
    return -(-req.kv.kv_allocated_len // page) * page - sched.release.cache_protected_len(req)


def pool_totals(sched) -> dict[str, tuple[int, int, int]]:
    """Each pool's available, evictable and protected tokens (the full pool, and the window's
    beside it), read through the calls both of SGLang's tree cores serve."""
    tree, alloc = sched.tree_cache, sched.allocator
    if not sched.config.swa:
        return {"full": (alloc.available_size(), tree.evictable_size(), tree.protected_size())}
    return {
        "full": (alloc.full_available_size(), tree.full_evictable_size(), tree.full_protected_size()),
        "swa": (alloc.swa_available_size(), tree.swa_evictable_size(), tree.swa_protected_size()),
    }


def check_conservation(sched) -> None:
    """available + evictable + protected + held by live requests == pool size, per pool."""
    tree, rel, config = sched.tree_cache, sched.release, sched.config
    live = sched.live_requests()
    held = {"full": sum(_private_full(sched, req) for req in live)}
    sizes = {"full": config.pool_tokens, "swa": config.swa_pool_tokens}
    if config.swa:
        held["swa"] = rel.swa_transient(tree) + sum(rel.swa_private_tokens(r, tree, config.page_size) for r in live)
    for name, (available, evictable, protected) in pool_totals(sched).items():
        uncached, total = held[name], sizes[name]
        if available + evictable + protected + uncached != total:
            raise Violation(
                "sglang-pool-conservation",
                f"{name} pool: available {available} + evictable {evictable} + protected {protected} + held by "
                f"live requests {uncached} = {available + evictable + protected + uncached}, pool size {total}",
                requests=[r.rid for r in live],
            )


def check_totals(sched) -> None:
    """The tree's evictable and protected totals equal the sums over its unlocked and locked
    non-root nodes' values (per component of a unified tree)."""
    tree = sched.tree_cache
    nodes = _nodes(tree)
    if _components(tree) is None:
        checks = [("", tree.evictable_size(), tree.protected_size(), FULL)]
    else:
        checks = [("full ", tree.full_evictable_size(), tree.full_protected_size(), FULL)]
        if sched.config.swa:
            checks.append(("swa ", tree.swa_evictable_size(), tree.swa_protected_size(), SWA))
    for label, evictable, protected, component in checks:
        want_e = want_p = 0
        for node in nodes:
            value = node_value(tree, node, component)
            if value is None:
                continue
            if _lock_ref(tree, node, component) > 0:
                want_p += len(value)
            else:
                want_e += len(value)
        if (evictable, protected) != (want_e, want_p):
            raise Violation(
                "sglang-running-totals",
                f"{label}evictable {evictable} / protected {protected}, but the tree's nodes hold "
                f"{want_e} unlocked / {want_p} locked",
            )


def check_lock_refs(sched) -> None:
    """Every non-root node's (full) lock count equals the live requests whose locked node lies in
    its subtree, and a locked node's ancestors are locked."""
    tree, rel = sched.tree_cache, sched.release
    root = tree_root(tree)
    expected: dict[int, int] = {}
    for req in sched.live_requests():
        handle = rel.locked_node(req)
        node = _node(tree, handle) if handle is not None else None
        while node is not None and node is not root:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
    for node in _nodes(tree):
        got, want = _lock_ref(tree, node), expected.get(id(node), 0)
        if got != want:
            raise Violation(
                "sglang-lock-ref",
                f"node {node.id} has lock_ref {got}, but {want} live requests are locked at or below it",
            )
        if got > 0 and node.parent is not root and _lock_ref(tree, node.parent) == 0:
            raise Violation("sglang-lock-ref", f"node {node.id} is locked but its parent {node.parent.id} is not")


def _free_slots(sched) -> list[int]:
    """The full pool's free slots: the allocator's free and pending-release pages, expanded."""
    alloc = getattr(sched.allocator, "full_attn_allocator", sched.allocator)
    page = sched.config.page_size
    pages = [int(p) for held in (alloc.free_pages, alloc.release_pages) if held is not None for p in held.tolist()]
    return [p * page + k for p in pages for k in range(page)]


def check_slots_disjoint(sched) -> None:
    """Tree node values, live requests' own slots (``[cache_protected_len, kv_allocated_len)`` of
    their req_to_token rows) and the allocator's free slots never share a full-pool slot."""
    tree, rel = sched.tree_cache, sched.release
    rows = sched.req_to_token_pool.req_to_token
    holders: list[tuple[str, list]] = []
    for node in _nodes(tree):
        value = node_value(tree, node)
        if value is not None:
            holders.append((f"tree node {node.id}", value.tolist()))
    for req in sched.live_requests():
        row = rows[rel.req_pool_idx(req)]
        holders.append((f"request {req.rid}", row[rel.cache_protected_len(req) : req.kv.kv_allocated_len].tolist()))
    holders.append(("the free list", _free_slots(sched)))
    owners: dict[int, str] = {}
    for who, slots in holders:
        for slot in slots:
            other = owners.setdefault(slot, who)
            if other is not who:
                raise Violation("sglang-slot-held-twice", f"KV slot {slot} is held by {other} and by {who}")


def check_idle(sched) -> None:
    """With every request ended: SGLang's own idle checks (``Scheduler.on_idle``:
    ``_check_all_pools`` over ``get_pool_stats()``, ``_check_req_pool``, 0.5.23's
    ``verify_byte_accounting``) and every req_to_token row free."""
    checker, pool = sched.invariant_checker, sched.req_to_token_pool
    has_leak, messages = checker._check_all_pools(sched.pool_stats_observer.get_pool_stats())
    if has_leak:
        raise Violation("sglang-idle-leak", "SGLang's idle pool check: " + "; ".join(m for m in messages if m))
    try:
        checker._check_req_pool()
    except ValueError as e:
        raise Violation("sglang-idle-leak", f"SGLang's idle req pool check: {e}") from None
    byte_errors = sched.release.verify_bytes(sched.allocator)
    if byte_errors:
        raise Violation("sglang-idle-leak", "SGLang's byte accounting: " + "; ".join(byte_errors))
    if len(pool.free_slots) != pool.size:
        raise Violation(
            "sglang-idle-leak", f"{pool.size - len(pool.free_slots)} req_to_token rows are held with no request"
        )


def check_all(sched) -> None:
    """Every check that applies now: the walks where the tree allows them, idle when idle."""
    check_conservation(sched)
    if walkable(sched):
        check_totals(sched)
        check_lock_refs(sched)
        check_slots_disjoint(sched)
    if sched.is_fully_idle():
        check_idle(sched)
