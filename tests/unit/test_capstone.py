"""Notebook 14's capstone: the reference manager passes all three checks, every planted classic bug fails with the
rule it breaks, the notebook's skeleton says "not implemented yet", and the engine seam refuses a non-callable.

Each planted bug is the reference solution with one method changed, so a failure can only come from that change.
"""

from __future__ import annotations

import ast
import html
import importlib.util
from pathlib import Path

import pytest

from minienv.engine import InferenceEngine
from minienv.exercises import NOT_IMPLEMENTED, PASSED, ExerciseFailed
from minienv.exercises import capstone as cap
from minienv.kv.hashing import ROOT_HASH, hash_block_chain, hash_block_tokens
from minienv.kv.interface import KVRequest

REPO = Path(__file__).resolve().parents[2]
CHECKS = (cap.check_rules, cap.check_random_ops, cap.check_in_engine)


def _solution():
    spec = importlib.util.spec_from_file_location("solutions_14_capstone", REPO / "solutions" / "14_capstone.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MyKVCacheManager


Good = _solution()


# ---------------------------------------------------------------------------------------- planted bugs
class IndexAtAllocation(Good):
    """Indexes the full blocks of the prompt when they are reserved, before the step has computed their K/V."""

    def allocate(self, request, num_new_tokens):
        got = super().allocate(request, num_new_tokens)
        if got is not None:  # commit, as if the reserved tokens were computed already
            Good.commit(self, KVRequest(request.request_id, request.all_token_ids, got + num_new_tokens))
        return got


class FreeHeadFirst(Good):
    def free(self, request_id):
        for b in self.tables.pop(request_id):  # first block first
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_q[b] = None
        del self.hashes[request_id]


class NoRefcountOnShared(Good):
    """A prefix hit sets the refcount to 1 instead of adding a holder."""

    def allocate(self, request, num_new_tokens):
        hit = self.lookup(request.all_token_ids)
        held = {b: self.refs[b] for b in hit}
        got = super().allocate(request, num_new_tokens)
        if got is not None:
            for b in hit:
                self.refs[b] = 1 if held[b] else self.refs[b]
        return got


class EvictInUse(Good):
    """A prefix hit on a cached-free block leaves it in the free queue, so a later allocation can take it."""

    def allocate(self, request, num_new_tokens):
        hit_free = [b for b in self.lookup(request.all_token_ids) if self.refs[b] == 0]
        got = super().allocate(request, num_new_tokens)
        if got is not None:
            for b in hit_free:
                self.free_q[b] = None
                self.free_q.move_to_end(b, last=False)
        return got


def _own_tokens_lookup(self, token_ids):
    if not self.caching:
        return []
    hit = []
    for j in range((len(token_ids) - 1) // self.block_size):
        h = hash_block_tokens(ROOT_HASH, token_ids[j * self.block_size:(j + 1) * self.block_size])
        if h not in self.by_hash:
            break
        hit.append(self.by_hash[h])
    return hit


def _commit(self, request, *, tokens=None, upto=None, chain=True, once=True):
    """The reference commit with one of its choices switchable: which tokens it hashes (``tokens``: a copy instead
    of ``request.all_token_ids``), how far (``upto`` tokens instead of ``num_computed_tokens``), whether block j's
    hash chains block j-1's, whether a hash already indexed is skipped."""
    if not self.caching:
        return
    B, rid = self.block_size, request.request_id
    table, hashes = self.tables[rid], self.hashes[rid]
    toks = request.all_token_ids if tokens is None else tokens
    for j in range(len(hashes), (request.num_computed_tokens if upto is None else upto) // B):
        h = hash_block_tokens(hashes[-1] if hashes and chain else ROOT_HASH, toks[j * B:(j + 1) * B])
        hashes.append(h)
        if not once or (h not in self.by_hash and table[j] not in self.hash_of):
            self.by_hash[h], self.hash_of[table[j]] = table[j], h


class HashOwnTokens(Good):
    """Each block hashed from its own tokens only, not chained to its prefix."""

    lookup = _own_tokens_lookup

    def commit(self, request):
        _commit(self, request, chain=False)


class TakeFromTail(Good):
    """Allocation takes the most recently freed block (MRU) instead of the least recently freed one."""

    def _take(self, n):
        out = []
        for _ in range(n):
            bid, _ = self.free_q.popitem(last=True)
            h = self.hash_of.pop(bid, None)
            if h is not None:
                del self.by_hash[h]
            self.refs[bid] = 1
            out.append(bid)
        return out


class StaleHashOnReuse(Good):
    """Reusing a cached-free block forgets to drop its hash: the index still points at overwritten K/V."""

    def _take(self, n):
        out = []
        for _ in range(n):
            bid, _ = self.free_q.popitem(last=False)
            self.refs[bid] = 1
            out.append(bid)
        return out


class LookupWholePrompt(Good):
    """Returns every cached full block, even when that leaves no token to compute for the logits."""

    def lookup(self, token_ids):
        if not self.caching:
            return []
        parent, hit = ROOT_HASH, []
        for j in range(len(token_ids) // self.block_size):
            parent = hash_block_tokens(parent, token_ids[j * self.block_size:(j + 1) * self.block_size])
            if parent not in self.by_hash:
                break
            hit.append(self.by_hash[parent])
        return hit


class AllocatePartly(Good):
    """Takes the prefix hit before checking that the new blocks fit, and keeps it when they do not."""

    def allocate(self, request, num_new_tokens):
        got = super().allocate(request, num_new_tokens)
        if got is None:
            for b in self.lookup(request.all_token_ids):
                if self.refs[b] == 0:
                    del self.free_q[b]
                self.refs[b] += 1
        return got


class NoCacheAfterFree(Good):
    """free drops the hashes of the blocks it releases: nothing survives its request."""

    def free(self, request_id):
        table = list(self.tables[request_id])
        super().free(request_id)
        for b in table:
            if self.refs[b] == 0 and b in self.hash_of:
                del self.by_hash[self.hash_of.pop(b)]


class ReindexTwin(Good):
    """commit indexes a full block even when its chain hash is already indexed: the twin replaces the first copy."""

    def commit(self, request):
        _commit(self, request, once=False)


class StaleTokenCopy(Good):
    """Keeps its own copy of the request's tokens, taken at allocate, and hashes that copy at commit: the tokens the
    request decodes later never reach it, so a block they fill is never indexed (the request-object contract's
    classic mistake: the tokens exist twice and the copy goes stale)."""

    def allocate(self, request, num_new_tokens):
        got = super().allocate(request, num_new_tokens)
        if got is not None:
            self.__dict__.setdefault("tokens", {})[request.request_id] = list(request.all_token_ids)
        return got

    def commit(self, request):
        copy = self.tokens[request.request_id]
        _commit(self, request, tokens=copy, upto=min(request.num_computed_tokens, len(copy)))


class HashBeyondComputed(Good):
    """commit hashes every full block of ``all_token_ids``, not only the computed ones: a block whose last token was
    sampled but not yet computed becomes findable before its K/V exist."""

    def commit(self, request):
        _commit(self, request, upto=len(request.all_token_ids))


def _allocate(self, request, num_new_tokens, *, count_hit_free=True, hit_first=True, remove_hit=True):
    """The reference allocate with one of its three steps about the hit switchable off."""
    B = self.block_size
    hit = self.lookup(request.all_token_ids)
    need = -(-(len(hit) * B + num_new_tokens) // B) - len(hit)
    hit_free = sum(1 for b in hit if self.refs[b] == 0) if count_hit_free else 0
    if need + hit_free > len(self.free_q):
        return None
    hashes = [self.hash_of[b] for b in hit]
    new = [] if hit_first else self._take(need)
    for b in hit:
        if remove_hit and b in self.free_q:
            del self.free_q[b]
        self.refs[b] += 1
    if hit_first:
        new = self._take(need)
    self.tables[request.request_id] = hit + new
    self.hashes[request.request_id] = hashes
    return len(hit) * B


class HitLeftInQueue(Good):
    """A cached-free hit gets its refcount but stays where it is in the free queue."""

    def allocate(self, request, num_new_tokens):
        return _allocate(self, request, num_new_tokens, remove_hit=False)


class HitNotCounted(Good):
    """The fit check forgets that taking a cached-free hit out of the queue leaves fewer free blocks (it then runs
    out of blocks half-way: a KeyError from the student's own OrderedDict)."""

    def allocate(self, request, num_new_tokens):
        return _allocate(self, request, num_new_tokens, count_hit_free=False)


class NewBlocksBeforeHit(Good):
    """New blocks are taken from the head before the hit is taken out of the queue: the head may be the hit."""

    def allocate(self, request, num_new_tokens):
        return _allocate(self, request, num_new_tokens, hit_first=False)


BUGS = [
    (IndexAtAllocation, "indexed at commit, never at allocation"),
    (FreeHeadFirst, "free releases the LAST block first"),
    (NoRefcountOnShared, "refcount equals the number of block tables"),
    (EvictInUse, "takes it out of the free queue"),
    (HashOwnTokens, "chains block j-1's hash"),
    (TakeFromTail, "HEAD of the free queue"),
    (StaleHashOnReuse, "an evicted block leaves the index"),
    (LookupWholePrompt, "at most (len - 1) // block_size"),
    (AllocatePartly, "changes nothing"),
    (NoCacheAfterFree, "stay cached"),
    (ReindexTwin, "scenario 10: commit indexes a newly full block only when its chain hash is not indexed yet"),
    (HitLeftInQueue, "takes it out of the free queue"),
    (HitNotCounted, "scenario 8: a cached-free hit counts against the free blocks"),
    (NewBlocksBeforeHit, "scenario 9: allocate takes the prefix hit before the new blocks"),
    (StaleTokenCopy, "scenario 12: commit reads the request at the call"),
    (HashBeyondComputed, "scenario 12: commit reads the request at the call"),
]


# ---------------------------------------------------------------------------------------- the checks
def test_reference_solution_is_written_from_scratch():
    """It implements the contract itself: no base class, and nothing imported from minienv but the chain hash."""
    assert Good.__bases__ == (object,)
    source = (REPO / "solutions" / "14_capstone.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert [i for i in imports if "minienv" in i] == ["from minienv.kv.hashing import ROOT_HASH, hash_block_tokens"]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_reference_solution_passes(check, capsys):
    assert check(Good) == PASSED
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("bug, words", BUGS, ids=[b.__name__ for b, _ in BUGS])
def test_planted_bug_fails_naming_its_rule(bug, words):
    """The first check that fails names the rule the bug breaks (the student runs them in order)."""
    with pytest.raises(ExerciseFailed) as info:
        for check in CHECKS:
            check(bug)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("✗ ") and words in first_line, f"{bug.__name__}: got {info.value}"


@pytest.mark.parametrize("bug", [EvictInUse, StaleHashOnReuse, NoRefcountOnShared],
                         ids=lambda b: b.__name__)
def test_the_engine_proof_alone_catches_the_unsafe_bugs(bug):
    """The engine check is not a formality: bugs that hand out wrong or live K/V change outputs (or break the
    engine's invariants) even when the rule scenarios are skipped."""
    with pytest.raises(ExerciseFailed):
        cap.check_in_engine(bug)


@pytest.mark.parametrize("bug, words", [
    (StaleTokenCopy, "a copy of the tokens taken at allocate goes stale"),
    (HashBeyondComputed, "a token sampled but not yet computed has no K/V"),
], ids=lambda x: getattr(x, "__name__", "words"))
def test_reading_the_request_wrongly_is_named_by_which_half_of_the_rule(bug, words):
    with pytest.raises(ExerciseFailed, match=words):
        cap.check_rules(bug)


def test_the_engine_hands_the_students_class_its_own_request_objects():
    """No adapter in between: the class's allocate / append_slots / commit receive the engine's ``Request`` itself
    (its tokens and progress, live), never ids and copied token lists (the contract before issue #33)."""
    from minienv.request import Request

    seen = []

    class Recording(Good):
        def allocate(self, request, num_new_tokens):
            seen.append(("allocate", request))
            return super().allocate(request, num_new_tokens)

        def append_slots(self, request, num_new_tokens):
            seen.append(("append_slots", request))
            return super().append_slots(request, num_new_tokens)

        def commit(self, request):
            seen.append(("commit", request))
            return super().commit(request)

    model, tok = cap._tiny_setup()
    eng = InferenceEngine(model, tok, kv_budget_tokens=64, block_size=4, kv_cache_manager_factory=cap.plug(Recording))
    eng.add_request(list(range(1, 10)), cap._workload()[1])
    reqs = dict(eng.scheduler.requests)
    while eng.has_unfinished_requests():
        eng.step()
    assert {name for name, _ in seen} == {"allocate", "append_slots", "commit"}
    assert all(isinstance(r, Request) and r is reqs[r.request_id] for _, r in seen)


def test_random_ops_alone_catches_a_wrong_hash():
    """Hashing a block's own tokens gives hits whose K/V were computed after another prefix: caught by content."""
    with pytest.raises(ExerciseFailed, match="only blocks whose computed K/V are exactly"):
        cap.check_random_ops(HashOwnTokens, seed=1)


@pytest.mark.parametrize("bug", [HitNotCounted, ReindexTwin], ids=lambda b: b.__name__)
def test_random_ops_names_a_rule_when_the_students_code_raises(bug):
    """Both bugs end in a KeyError inside the student's own code under random operations: the check reports the
    operation and the rule with that error, never the student's traceback (issue #36 found it crashing)."""
    with pytest.raises(ExerciseFailed) as info:
        cap.check_random_ops(bug)
    first, detail = str(info.value).split("\n", 1)
    assert first.startswith("✗ random operation ") and "raised KeyError" in detail


def test_a_crashing_method_in_a_scenario_names_that_scenarios_rule():
    class CrashOnFree(Good):
        def free(self, request_id):
            raise IndexError("oops")

    with pytest.raises(ExerciseFailed) as info:
        cap.check_rules(CrashOnFree)
    text = str(info.value)
    assert text.startswith("✗ scenario 1: ") and "your free('a') raised IndexError: oops" in text

    class CrashOnCommit(Good):
        def commit(self, request):
            raise ValueError("no")

    with pytest.raises(ExerciseFailed) as info:  # a request is shown by its id and progress, not its tokens
        cap.check_rules(CrashOnCommit)
    assert "your commit(<request 'a': 9 tokens, 9 computed>) raised ValueError: no" in str(info.value)


def _solution_of(notebook, name):
    spec = importlib.util.spec_from_file_location(f"sol_{notebook}", REPO / "solutions" / f"{notebook}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_the_students_victim_policy_from_07_runs_in_the_engine_with_their_manager(capsys):
    """The series' pieces come together: notebook 07's victim policy chooses whom the tight budget preempts, with
    the student's manager; outputs stay equal to each request alone."""
    assert cap.check_in_engine(Good, victim_policy=_solution_of("07_scheduling", "fewest_computed")) == PASSED
    assert "chosen by your victim policy" in capsys.readouterr().out


def test_a_victim_policy_that_breaks_its_own_rule_is_named():
    with pytest.raises(ExerciseFailed, match="your victim policy .notebook 07. returns one of the candidates"):
        cap.check_in_engine(Good, victim_policy=lambda candidates: candidates[0].request_id)


def test_index_at_allocation_passes_the_engine_proof():
    """Why the rules scenario, not the engine, catches this bug: in minienv's engine a same-step hit reads K/V the
    same forward pass writes before attending, so outputs cannot show it. The notebook says so; this pins it."""
    assert cap.check_in_engine(IndexAtAllocation) == PASSED


# ---------------------------------------------------------------------------------------- the notebook
def _skeleton():
    source = (REPO / "notebooks" / "14_capstone.py").read_text()
    defs = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "MyKVCacheManager"]
    assert len(defs) == 1, "notebooks/14_capstone.py must define MyKVCacheManager once"
    namespace: dict = {}
    imports = [n for n in ast.parse(source).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports + defs, type_ignores=[]), "14_capstone.py", "exec"), namespace)
    return namespace["MyKVCacheManager"], source


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_committed_skeleton_is_not_implemented(check, capsys):
    skeleton, source = _skeleton()
    assert check(skeleton) == NOT_IMPLEMENTED
    assert capsys.readouterr().out.startswith("not implemented yet — ")
    assert f"{check.__name__}(MyKVCacheManager" in source


# ---------------------------------------------------------------------------------------- the engine seam
def test_engine_seam_refuses_a_non_callable():
    model, tok = cap._tiny_setup()
    with pytest.raises(ValueError, match="kv_cache_manager_factory must be a callable"):
        InferenceEngine(model, tok, kv_budget_tokens=64, block_size=4, kv_cache_manager_factory=42)


def test_engine_seam_uses_the_factory_with_the_engine_geometry():
    model, tok = cap._tiny_setup()
    calls = []

    def factory(num_blocks, block_size, enable_prefix_caching):
        calls.append((num_blocks, block_size, enable_prefix_caching))
        return cap.plug(Good)(num_blocks, block_size, enable_prefix_caching)

    eng = InferenceEngine(model, tok, kv_budget_tokens=66, block_size=4, enable_prefix_caching=False,
                          kv_cache_manager_factory=factory)
    assert calls == [(16, 4, False)] and isinstance(eng.kv_cache_manager, cap.PluggedManager)
    assert eng.kv_budget_tokens == 64


def test_the_students_plan_step_from_07_sizes_the_engines_prefill_chunks(capsys):
    """Notebook 07's plan_step splits each step's budget in a third run (8 tokens per step, prompts prefilled in
    chunks), with the student's manager and victim policy; outputs stay equal to each request alone."""
    assert cap.check_in_engine(Good, victim_policy=_solution_of("07_scheduling", "fewest_computed"),
                               plan_step=_solution_of("07_scheduling", "plan_step")) == PASSED
    assert "prefill chunks sized by your plan_step" in capsys.readouterr().out


@pytest.mark.parametrize("plan_step, words", [
    (lambda needs, budget: list(needs), "never computes more tokens than the budget"),
    (lambda needs, budget: [0] * len(needs), "prefill chunks take the rest of the budget"),
    (lambda needs, budget: list(needs) + [0], "one number per running request"),
    (lambda needs, budget: 1 / 0, "plan_step runs without an exception"),
])
def test_a_plan_step_that_breaks_its_rule_in_the_engine_is_named(plan_step, words):
    with pytest.raises(ExerciseFailed, match=words):
        cap.check_in_engine(Good, plan_step=plan_step)


# ---------------------------------------------------------------------------------------- the student's engine
def _cell(source: str, first_line: str) -> str:
    """The notebook code cell that contains ``first_line``, as written."""
    cells = source.split("# %%")
    [cell] = [c for c in cells if first_line in c]
    return cell.split("\n", 1)[1]


def test_passed_only_after_all_three_gradings_of_this_very_class(capsys):
    fewest = _solution_of("07_scheduling", "fewest_computed")
    plan = _solution_of("07_scheduling", "plan_step")

    class Fresh(Good):  # a class object no check has seen
        pass

    assert not cap.passed(Fresh)
    assert cap.check_rules(Fresh) == PASSED and not cap.passed(Fresh)
    assert cap.check_random_ops(Fresh) == PASSED and not cap.passed(Fresh)
    assert cap.check_in_engine(Fresh, victim_policy=fewest, plan_step=plan) == PASSED
    assert cap.passed(Fresh, victim_policy=fewest, plan_step=plan)
    assert not cap.passed(Fresh) and not cap.passed(Fresh, victim_policy=fewest)  # graded with other 07 pieces

    class Redefined(Good):  # the student edits and re-runs the class cell: nothing passed yet
        pass

    assert not cap.passed(Redefined, victim_policy=fewest, plan_step=plan)
    with pytest.raises(ExerciseFailed):
        cap.check_rules(FreeHeadFirst)
    with pytest.raises(ExerciseFailed):  # a failing run takes back an earlier pass
        cap.check_in_engine(Fresh, victim_policy=lambda candidates: None, plan_step=plan)
    assert not cap.passed(Fresh, victim_policy=fewest, plan_step=plan)


def test_the_skeleton_plugs_the_students_05_and_06_pieces_into_the_class():
    skeleton, _ = _skeleton()
    seen = []

    def chain_hashes(tokens, block_size):  # the student's notebook-05 function, as pasted
        seen.append("chain_hashes")
        return hash_block_chain(tokens, block_size)

    def safe_victims(lru_order, refcount, n):  # the student's notebook-06 function, as pasted
        seen.append("safe_victims")
        return [b for b in lru_order if refcount[b] == 0][:n]

    skeleton.block_keys.__globals__.update(chain_hashes=chain_hashes, safe_victims=safe_victims)

    class Wired(Good):  # the reference's state, the skeleton's two plug-in methods
        block_keys = skeleton.block_keys
        take_from_head = skeleton.take_from_head

    m = Wired(6, 4, True)
    tokens = list(range(10, 23))
    assert m.block_keys(tokens) == hash_block_chain(tokens, 4)  # 3 full blocks, chained from ROOT_HASH
    m.allocate(KVRequest("a", tokens), len(tokens))
    assert m.take_from_head(2) == m.free_queue()[:2] == [4, 5]
    assert seen == ["chain_hashes", "safe_victims"]


def test_your_engine_cell_serves_with_the_students_pieces_and_proves_them_equal(capsys):
    """The notebook's last experiment, run as a student who passed all three gradings runs it: their class (05 and 06
    inside), their 07 victim policy and plan_step in the engine; the cell after it asserts minienv's answers."""
    source = (REPO / "notebooks" / "14_capstone.py").read_text()
    serve, proof = _cell(source, "REAL_MODEL = False"), _cell(source, "assert hits > 0 and preempted > 0")
    ns = {"capstone": cap, "InferenceEngine": InferenceEngine, "MyKVCacheManager": Good,
          "fewest_computed": _solution_of("07_scheduling", "fewest_computed"),
          "plan_step": _solution_of("07_scheduling", "plan_step")}
    calls = []
    policy = ns["fewest_computed"]
    ns["fewest_computed"] = lambda candidates: calls.append(len(candidates)) or policy(candidates)
    for check in (cap.check_rules, cap.check_random_ops):
        assert check(Good) == PASSED
    assert cap.check_in_engine(Good, victim_policy=ns["fewest_computed"], plan_step=ns["plan_step"]) == PASSED
    calls.clear()
    exec(serve, ns)  # noqa: S102 - the repository's own notebook
    assert ns["yours"] and isinstance(ns["engine"].kv_cache_manager, cap.PluggedManager)
    assert "serving with your pieces" in capsys.readouterr().out
    assert calls, "the student's victim policy chose whom the 6-block memory preempted"
    exec(proof, ns)  # noqa: S102 - its asserts: hits, a preemption, and minienv's answers, token for token
    assert ns["hits"] > 0 and ns["preempted"] > 0


def test_your_engine_cell_falls_back_to_minienvs_pieces_until_the_gradings_pass(capsys):
    source = (REPO / "notebooks" / "14_capstone.py").read_text()
    skeleton, _ = _skeleton()
    ns = {"capstone": cap, "InferenceEngine": InferenceEngine, "MyKVCacheManager": skeleton,
          "fewest_computed": None, "plan_step": None}
    exec(_cell(source, "REAL_MODEL = False"), ns)  # noqa: S102
    assert not ns["yours"] and not isinstance(ns["engine"].kv_cache_manager, cap.PluggedManager)
    assert "minienv's pieces (yours once the three gradings above pass)" in capsys.readouterr().out


def test_your_pieces_cell_shows_no_other_chapters_answer(capsys):
    """The cell where a student pastes their 05/06/07 functions defines none itself: a piece left as None is replaced
    by minienv's, named (the fallback used to print notebook 06's exercise-2 answer as code)."""
    from minienv.exercises.lru_eviction import check_safe_victims, safe_victims_reference

    source = (REPO / "notebooks" / "14_capstone.py").read_text()
    cell = _cell(source, "safe_victims = None")
    assert not [n for n in ast.walk(ast.parse(cell)) if isinstance(n, (ast.FunctionDef, ast.Lambda))], cell
    ns: dict = {}
    exec(cell, ns)  # noqa: S102 - the repository's own notebook
    assert ns["safe_victims"] is safe_victims_reference and ns["chain_hashes"] is hash_block_chain
    assert check_safe_victims(safe_victims_reference) == PASSED  # minienv's piece is the rule 06's check grades


# ---------------------------------------------------------------------------------------- the widget on the class
def _notebook_script():
    """The notebook's own six-call script (its first widget's cell, run as written) and its request-forgetting."""
    source = (REPO / "notebooks" / "14_capstone.py").read_text()
    ns: dict = {}
    exec(_cell(source, "SCRIPT = ["), ns)  # noqa: S102 - the repository's own notebook
    return ns["SCRIPT"], ns["requests"].clear


def test_the_widget_steps_the_students_class_and_draws_its_pool():
    """Issue #36 item 4: the live view drives the student's class (plugged), not minienv's manager; the reference
    class leaves the same pool as minienv's after every call, and the drawing is the student's state."""
    from minienv.exercises.capstone_watch import ScriptWatch
    from minienv.viz.kv_views import manager_cells

    script, reset = _notebook_script()
    watch = ScriptWatch(Good, script, reset)
    assert watch.yours and isinstance(watch.manager, cap.PluggedManager) and isinstance(watch.manager.core, Good)
    verdicts = []
    while watch.stepper.step():
        verdicts.append(watch.stepper.caption)
        core = watch.manager.core
        cells = manager_cells(watch.manager)
        assert [c.refcount for c in cells] == core.refs  # the picture is the student's refcounts
        assert [c.state == "cached" for c in cells] == [core.refs[b] == 0 and b in core.hash_of for b in range(6)]
    assert len(verdicts) == 6 and all(v == "same pool as minienv's" for v in verdicts), verdicts
    assert watch.first_difference is None and watch.error is None
    assert watch.view.evicted_total == [1]  # step 5's eviction, seen through the student's observers
    drawn = html.unescape(watch.static().data)
    assert "your MyKVCacheManager: 6 blocks of 4 tokens" in drawn and "step 6: commit new" in drawn


def test_the_widget_names_the_first_call_where_a_buggy_class_leaves_minienvs_pool():
    from minienv.exercises.capstone_watch import ScriptWatch

    script, reset = _notebook_script()
    watch = ScriptWatch(FreeHeadFirst, script, reset)
    watch.stepper.run()
    assert watch.yours and watch.first_difference.startswith("step 4: free queue (block, cached): yours ")
    assert "differs from minienv's" in watch.view.grid.caption


def test_the_widget_shows_a_students_exception_in_its_caption_and_stops():
    from minienv.exercises.capstone_watch import ScriptWatch

    class CrashOnFree(Good):
        def free(self, request_id):
            raise IndexError("oops")

    script, reset = _notebook_script()
    watch = ScriptWatch(CrashOnFree, script, reset)
    assert watch.stepper.run() == 3  # the third call raised: no step after it
    assert watch.error == "IndexError: oops" and watch.first_difference == "step 3 raised IndexError: oops"
    assert "stopped: IndexError: oops" in watch.view.grid.caption


def test_the_widget_shows_minienvs_manager_until_the_class_is_written():
    from minienv.exercises.capstone_watch import ScriptWatch

    skeleton, _ = _skeleton()
    script, reset = _notebook_script()
    watch = ScriptWatch(skeleton, script, reset)
    assert not watch.yours and not isinstance(watch.manager, cap.PluggedManager)
    watch.stepper.run()
    assert watch.first_difference is None
    assert "minienv's KVCacheManager (yours once it is written)" in html.unescape(watch.static().data)


def test_the_plugged_class_is_a_kv_manager_and_refuses_slots_ahead_of_the_computed_tokens():
    """The plug satisfies the engine's protocol; what the contract cannot do (reserve after tokens not yet computed,
    as static batching's padding does) is refused with a clear error, nothing changed."""
    from minienv.kv.errors import KVCacheError
    from minienv.kv.interface import KVManager

    m = cap.plug(Good)(8, 4, True)
    assert isinstance(m, KVManager)
    req = KVRequest("a", list(range(9)))
    alloc = m.allocate(req)
    assert (alloc.start, alloc.num_new_tokens, list(alloc.slot_mapping)) == (0, 9, list(range(9)))
    before = (m.core.block_table("a"), m.core.free_queue())
    with pytest.raises(KVCacheError, match="9 slots reserved but 0 computed"):
        m.append_slots(req, 1)
    assert (m.core.block_table("a"), m.core.free_queue()) == before
    req.num_computed_tokens = 9
    assert m.commit(req) == m.core.block_table("a")[:2]  # the blocks the student's commit indexed
    req.all_token_ids.append(9)
    alloc = m.append_slots(req, 1)
    assert (alloc.start, list(alloc.slot_mapping)) == (9, [m.core.block_table("a")[2] * 4 + 1])


def test_the_widget_never_raises_on_a_class_that_cannot_be_built_or_read():
    """A student's class is shown, not a traceback: one whose constructor raises is named in the title (minienv's
    manager drawn instead); one whose block table cannot be read stops with the error in the caption."""
    from minienv.exercises.capstone_watch import ScriptWatch

    class BadInit(Good):
        def __init__(self, num_blocks, block_size, enable_prefix_caching=True):
            raise TypeError("missing refs")

    class ShortTable(Good):
        def block_table(self, request_id):
            return super().block_table(request_id)[:1]

    script, reset = _notebook_script()
    watch = ScriptWatch(BadInit, script, reset)
    assert not watch.yours and watch.build_error == "TypeError: missing refs"
    assert "building yours raised TypeError: missing refs" in html.unescape(watch.static().data)
    watch = ScriptWatch(ShortTable, script, reset)
    assert watch.yours and watch.stepper.run() == 1
    assert watch.error.startswith("KVCacheError: your block_table('a') has 1 blocks for 9 tokens")
    assert "stopped: KVCacheError" in watch.view.grid.caption
