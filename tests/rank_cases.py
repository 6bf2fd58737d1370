"""Several test cases in one launch of gloo ranks (a launch costs process start, imports and a rendezvous): inside a
rank, `prefixed(case, results)` keys one case's results "<case>.<key>"; in the test, `of_case(ranks, case)` takes
them back apart, one dict a rank with the case's own keys, so each test checks only its own case."""

from __future__ import annotations


def prefixed(case: str, results: dict) -> dict:
    return {f"{case}.{key}": value for key, value in results.items()}


def of_case(ranks: list[dict], case: str) -> list[dict]:
    prefix = f"{case}."
    return [{key[len(prefix):]: value for key, value in rank.items() if key.startswith(prefix)} for rank in ranks]
