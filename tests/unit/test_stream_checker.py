"""The vector-clock checker behind TANDEM_STREAM_CHECK, on hand-written access sequences."""

import pytest

from tandem.runtime.streams import StreamChecker, StreamOrderError


def test_read_after_write_needs_an_event():
    c = StreamChecker()
    c.write("buf", "plan")
    with pytest.raises(StreamOrderError, match="main stream reads 'buf'.*plan"):
        c.read("buf", "main")


def test_event_after_the_write_orders_the_read():
    c = StreamChecker()
    c.write("buf", "plan")
    snap = c.snapshot("plan")
    c.merge("main", snap)
    c.read("buf", "main")


def test_event_recorded_before_the_write_does_not_order_it():
    c = StreamChecker()
    snap = c.snapshot("plan")  # "moved" edge: recorded at the producer's start
    c.write("buf", "plan")
    c.merge("main", snap)
    with pytest.raises(StreamOrderError):
        c.read("buf", "main")


def test_write_after_read_needs_an_event():
    c = StreamChecker()
    c.write("table", "plan")
    c.merge("main", c.snapshot("plan"))
    c.read("table", "main")
    with pytest.raises(StreamOrderError, match="write-after-read"):
        c.write("table", "plan")
    c2 = StreamChecker()
    c2.write("table", "plan")
    c2.merge("main", c2.snapshot("plan"))
    c2.read("table", "main")
    c2.merge("plan", c2.snapshot("main"))  # event after main's last read
    c2.write("table", "plan")


def test_write_after_write_needs_an_event():
    c = StreamChecker()
    c.write("buf", "main")
    with pytest.raises(StreamOrderError, match="write-after-write"):
        c.write("buf", "plan")


def test_ordering_is_transitive_through_a_third_stream():
    c = StreamChecker()
    c.write("buf", "plan")
    c.merge("main", c.snapshot("plan"))
    c.merge("host", c.snapshot("main"))
    c.read("buf", "host")


def test_same_stream_is_program_ordered():
    c = StreamChecker()
    c.write("buf", "main")
    c.read("buf", "main")
    c.write("buf", "main")
