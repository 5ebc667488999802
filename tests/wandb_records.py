"""The records of an offline wandb run, read from its .wandb file (wandb's own protobufs)."""
from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path


def _wandb_records(run_dir: str) -> list:
    """The wandb Records of an offline run, read from its .wandb transaction log.

    The file is a 7-byte header then LevelDB-log records (32 KiB blocks; each chunk has a
    crc32, a 2-byte length and a type: 1 full, 2 first, 3 middle, 4 last) of wandb Records.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += room
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir: str) -> list[dict]:
    """History rows of an offline run."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
            for record in _wandb_records(run_dir)
            if record.WhichOneof("record_type") == "history"]


def wandb_run(run_dir: str) -> tuple[str, dict]:
    """(display name, config) of an offline run."""
    (run,) = [r.run for r in _wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return run.display_name, {k: v.get("value", v) if isinstance(v, dict) else v
                              for k, v in config.items()}
