from hypothesis import example, given
from hypothesis import strategies as st

from workers.text import IncrementalText


def _feed(pieces: list[str], stop: tuple[str, ...]) -> tuple[str, bool]:
    inc = IncrementalText(stop)
    text, sent = "", ""
    for piece in pieces:
        text += piece
        sent += inc.update(text)
        if inc.stopped:
            break
    else:
        sent += inc.update(text, final=True)
    return sent, inc.stopped


def test_plain_text_streams_through() -> None:
    assert _feed(["Hel", "lo", " world"], ()) == ("Hello world", False)


def test_stop_string_cuts_and_is_not_sent() -> None:
    assert _feed(["Hello", " EN", "D more"], ("END",)) == ("Hello ", True)


def test_partial_stop_prefix_is_held_then_released() -> None:
    inc = IncrementalText(("END",))
    assert inc.update("abc E") == "abc "
    assert inc.update("abc EX") == "EX"


def test_incomplete_utf8_is_held() -> None:
    inc = IncrementalText(())
    assert inc.update("a\ufffd") == "a"
    assert inc.update("a\u00e9") == "\u00e9"


@example(["aY", "Y"], ["Y", "aYY"])
@given(
    st.lists(st.text(alphabet="abcXY \n", max_size=4), max_size=12),
    st.lists(st.text(alphabet="abXY\n", min_size=1, max_size=3), max_size=2),
)
def test_streamed_text_equals_cut_text(pieces: list[str], stops: list[str]) -> None:
    full = "".join(pieces)
    sent, stopped = _feed(pieces, tuple(stops))
    # the stream is cut at the earliest stop string in the text when one first appeared (a stop
    # that would only complete with later text never does: generation stops there; hypothesis
    # found pieces ["aY", "Y"] with stops ["Y", "aYY"], cut after "a"); with no stop it is the whole text
    seen = ""
    for piece in pieces:
        seen += piece
        if any(s in seen for s in stops):
            break
    cuts = [seen.find(s) for s in stops if s in seen]
    if stopped:
        assert full.startswith(sent)
        assert any(full[len(sent):].startswith(s) for s in stops)
        assert min(cuts) == len(sent)
    else:
        assert sent == full
        assert not cuts
