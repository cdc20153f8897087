from services.router.stops import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for d in deltas:
        text, stopped = m.push(d)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_no_stops_passes_text_through() -> None:
    assert run([], ["a", "b"]) == ("ab", False)


def test_stop_split_across_deltas_is_not_emitted() -> None:
    assert run(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_partial_match_that_fails_is_released() -> None:
    m = StopMatcher(["END"])
    assert m.push("hello EN") == ("hello ", False)
    assert m.push("o") == ("ENo", False)


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "lo"], ["hello world"]) == ("hel", True)


def test_held_text_is_flushed_at_the_end() -> None:
    assert run(["END"], ["the E"]) == ("the E", False)
