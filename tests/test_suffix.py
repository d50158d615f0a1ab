"""The suffix drafter: drafts from the request itself and from earlier requests' outputs, with a bounded history
whose counts stay exact under eviction and concurrent writers. (Greedy equality and the sampling distribution are
checked with every other drafter in test_engine.py.)"""

import random
import threading
import time
from dataclasses import dataclass, field

import pytest

from specwise.engine.drafters.suffix import SuffixDrafter, SuffixIndex
from specwise.errors import SpecwiseError
from specwise.specs import check_drafter_spec


@dataclass
class View:
    slot: int
    token_ids: list[int]
    prompt_len: int
    history: bool = True
    params: object = None
    noise: object = None
    verify: str = "coupled"
    extra: list = field(default_factory=list)


def rebuilt(index: SuffixIndex) -> dict:
    fresh = SuffixIndex(index.depth)
    for seq in index.sequences:
        fresh.add(seq)
    return fresh.next


def test_a_later_request_is_drafted_from_an_earlier_ones_output():
    d = SuffixDrafter()
    first = View(0, [1, 2, 3, 40, 41, 42, 43, 44, 45], prompt_len=3)
    d.propose([first], [4])
    d.release(0)  # its output [40..45] joins the history
    later = View(0, [9, 8, 40, 41], prompt_len=2)
    assert d.propose([later], [3])[0].tokens == [42, 43, 44]
    fresh = SuffixDrafter()
    assert fresh.propose([View(0, [9, 8, 40, 41], prompt_len=2)], [3])[0].tokens == []


def test_the_request_itself_is_drafted_from_and_k_caps_the_draft():
    d = SuffixDrafter()
    seq = View(1, [7, 8, 9, 7, 8, 9, 7, 8], prompt_len=8)
    assert d.propose([seq], [2])[0].tokens == [9, 7]
    assert d.propose([seq], [0])[0].tokens == []


def test_an_unconfident_continuation_is_not_drafted():
    index = SuffixIndex()
    for tail in ([1, 2, 3], [1, 2, 4], [1, 2, 5]):  # after (1, 2) nothing has half the counts
        index.add(tail)
    assert index.continuation([1, 2], 3) == []
    index.add([1, 2, 3])
    index.add([1, 2, 3])
    assert index.continuation([1, 2], 3) == [3]


def test_the_history_stays_within_its_bound_and_its_counts_exact():
    rng = random.Random(0)
    index = SuffixIndex(max_tokens=100)
    for _ in range(200):
        index.add([rng.randrange(20) for _ in range(rng.randint(2, 30))])
        assert index.tokens <= 100 and index.tokens == sum(len(s) for s in index.sequences)
    assert index.next == rebuilt(index)  # eviction took back exactly what it had counted
    assert index.nbytes() > 0


def test_concurrent_writers_do_not_corrupt_the_history():
    index = SuffixIndex(max_tokens=2000)

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            index.add([rng.randrange(50) for _ in range(rng.randint(2, 20))])
            index.continuation([rng.randrange(50) for _ in range(3)], 4)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert index.tokens <= 2000 and index.next == rebuilt(index)


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("suffix:abc", "suffix:TOKENS takes"),
        ("suffix:-5", "suffix:TOKENS takes"),
    ],
)
def test_bad_suffix_specs_are_refused(spec, needle):
    with pytest.raises(SpecwiseError, match=needle):
        check_drafter_spec(spec)
    assert check_drafter_spec("suffix") == "suffix" and check_drafter_spec("suffix:0") == "suffix:0"


def test_a_request_that_opts_out_neither_reads_nor_writes_the_history():
    d = SuffixDrafter()
    private = View(0, [1, 2, 3, 40, 41, 42, 43, 44], prompt_len=3, history=False)
    d.propose([private], [4])
    d.release(0)
    assert d.history.tokens == 0  # its output was not kept
    assert d.propose([View(1, [9, 40, 41], prompt_len=1)], [3])[0].tokens == []  # so nobody drafts from it
    shared = View(2, [1, 2, 3, 50, 51, 52, 53], prompt_len=3)
    d.propose([shared], [2])
    d.release(2)
    assert d.propose([View(3, [9, 50, 51], prompt_len=1)], [2])[0].tokens == [52, 53]
    assert d.propose([View(4, [9, 50, 51], prompt_len=1, history=False)], [2])[0].tokens == []  # nor reads it


def test_a_server_can_turn_the_shared_history_off():
    d = SuffixDrafter(max_tokens=0)
    d.propose([View(0, [1, 2, 3, 40, 41, 42, 43], prompt_len=3)], [2])
    d.release(0)
    assert d.history.tokens == 0 and d.name == "suffix:0"
    assert d.propose([View(1, [9, 40, 41], prompt_len=1)], [2])[0].tokens == []


def test_the_server_honours_the_opt_out_and_shows_the_history_size(tiny):
    import httpx
    from test_server import Live

    from specwise.engine import Engine

    live = Live(Engine(tiny, drafter="suffix", k=3, max_batch=4))
    try:

        def ask(spec: dict | None) -> httpx.Response:
            body = {"model": "tiny", "prompt": "abc abc abc abd", "max_tokens": 16, "temperature": 0}
            return httpx.post(live.url + "/v1/completions", json=body | ({"speculative": spec} if spec else {}))

        assert ask({"history": False}).status_code == 200
        time.sleep(0.2)
        assert live.gauge("specwise_suffix_history_tokens") == 0  # an opted-out request leaves nothing behind
        assert ask(None).status_code == 200
        time.sleep(0.2)
        assert live.gauge("specwise_suffix_history_tokens") > 0 and live.gauge("specwise_suffix_history_bytes") > 0
        bad = ask({"history": "sometimes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.history"
    finally:
        live.close()
