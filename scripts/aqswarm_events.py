"""Reads aqswarm's progress events (proto/events.proto) in Python.

The stage and peer processes print one JSON object per line in protobuf's JSON
mapping; this module parses each line with protobuf itself (the classes that
the build generates into build/python/proto/events_pb2.py), so scripts see the
same schema as the C++ side (proto/event_json.h):

    from aqswarm_events import read_events
    for kind, ev in read_events("runs/tiny/events.jsonl"):
        if kind == "step":
            print(ev["step"], ev["loss"], ev["fw_bytes"])

Each event comes as (kind, dict): the dict has proto field names, every field
(zeros too), numbers as numbers (64-bit integers as ints, NaN as float) and nested groups as dicts; a group the
event does not carry (e.g. "dp" without data parallelism) is absent. A peer
daemon's line that passes on its stage's event comes as that stage event.

The build directory is $AQSWARM_BUILD, else build/ beside scripts/.
"""
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD = os.environ.get("AQSWARM_BUILD") or os.path.join(os.path.dirname(_HERE), "build")
_PY = os.path.join(_BUILD, "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)

try:
    from google.protobuf import json_format
except ImportError:  # a Python of its own (pyenv, venv) beside Debian's python3-protobuf
    sys.path.append("/usr/lib/python3/dist-packages")
try:
    from google.protobuf import json_format
    from proto import events_pb2
except ImportError as e:  # pragma: no cover - a setup problem, said clearly
    raise ImportError(f"aqswarm_events needs python3-protobuf and a build ({_PY}/proto/events_pb2.py): {e}")


class EventError(ValueError):
    """A line that is not an event of the expected kind."""


def _to_dict(msg):
    # protobuf 5 renamed including_default_value_fields (Debian 12 has 3.21).
    try:
        return json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                         including_default_value_fields=True)
    except TypeError:
        return json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)


def _numbers(msg, d):
    """json_format writes 64-bit integers and non-finite doubles as strings;
    make them numbers again."""
    for f in msg.DESCRIPTOR.fields:
        if f.name not in d:
            continue
        if f.message_type is not None:
            _numbers(getattr(msg, f.name), d[f.name])
        elif f.cpp_type in (f.CPPTYPE_INT64, f.CPPTYPE_UINT64):
            d[f.name] = int(d[f.name])
        elif f.cpp_type in (f.CPPTYPE_DOUBLE, f.CPPTYPE_FLOAT):
            d[f.name] = float(d[f.name])
    return d


def _parse(line, cls):
    msg = cls()
    try:
        json_format.Parse(line, msg)
    except (json_format.ParseError, json.JSONDecodeError) as e:
        raise EventError(f"not a {cls.DESCRIPTOR.name} line ({e}): {line[:200]}")
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise EventError(f"a {cls.DESCRIPTOR.name} without a kind: {line[:200]}")
    return kind, getattr(msg, kind)


def parse_stage_event(line):
    """One `aqswarm stage` line -> (kind, dict). Raises EventError."""
    kind, body = _parse(line, events_pb2.StageEvent)
    return kind, _numbers(body, _to_dict(body))


def parse_peer_event(line):
    """One `aqswarm peer` line -> (kind, dict); a passed-on stage event comes
    as that event's (kind, dict). Raises EventError."""
    kind, body = _parse(line, events_pb2.PeerEvent)
    if kind == "stage":
        inner = body.WhichOneof("kind")
        if inner is None:
            raise EventError(f"a passed-on stage event without a kind: {line[:200]}")
        body, kind = getattr(body, inner), inner
    return kind, _numbers(body, _to_dict(body))


def parse_event(line):
    """A line of either process: a stage event, else a peer event."""
    try:
        return parse_stage_event(line)
    except EventError:
        return parse_peer_event(line)


def read_events(path, kinds=None, strict=True):
    """(kind, dict) for every event line of a file; lines that are not JSON
    objects (log text) are skipped, a JSON object that is no event raises
    (strict) or is skipped (a file still being written ends in half a line)."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                kind, ev = parse_event(line)
            except EventError:
                if strict:
                    raise
                continue
            if kinds is None or kind in kinds:
                yield kind, ev


def _main(argv):
    """aqswarm_events.py fields KIND FIELD... -- FILE...: one line per event of
    KIND, its FIELDs separated by spaces (a nested field as group.name), for
    shell scripts."""
    if len(argv) < 4 or argv[0] != "fields" or "--" not in argv:
        print(_main.__doc__, file=sys.stderr)
        return 2
    sep = argv.index("--")
    kind, fields, paths = argv[1], argv[2:sep], argv[sep + 1:]
    for path in paths:
        for _, ev in read_events(path, kinds={kind}, strict=False):
            values = []
            for f in fields:
                v = ev
                for part in f.split("."):
                    v = v.get(part, "") if isinstance(v, dict) else ""
                values.append(str(v))
            print(" ".join(values))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
