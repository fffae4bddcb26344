"""The detokenizer sends each request's outputs to the API server it came from (the origin its NEW
named), one OUTPUTS batch per API server per step."""

from __future__ import annotations

from dataclasses import asdict

from kiln.runtime.sampling import SamplingParams
from kiln.server.detokenizer_process import Detokenizer


def event(rid: str, token: int, finish: str | None = None) -> list:
    return [rid, 0, [token], [], finish, None, 3, 0, 0, 0, [], None]


def test_outputs_go_back_to_their_api_server():
    detokenizer = Detokenizer(None)
    params = asdict(SamplingParams(max_new_tokens=2))
    detokenizer.add("a", [1, 2], params, 0)
    detokenizer.add("b", [1, 2], params, 1)
    detokenizer.add("c", [1, 2], params, 1)
    step = detokenizer.outputs([event("a", 5), event("b", 6), event("c", 7, "length")])
    assert {origin: [output[0] for output in outputs] for origin, outputs in step.items()} == {0: ["a"], 1: ["b", "c"]}
    assert step[1][1][3] == [7] and step[1][1][5] == "length"
    assert list(detokenizer.outputs([event("b", 8, "length")])) == [1]
