"""Compression report: raw protobuf vs zstd level 3, with and without a trained dictionary.

    python -m bench.compression [--requests 4000] [--seed 8] [--write]

The dictionary is trained on traffic from another seed than the one measured (train/test split), on single
requests, as an operator would train it from a capture. Sizes are of the payload frame the agent sends; the
envelope (about 60 bytes, never compressed) is reported separately.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from bench.report import machine, stamp, table, update_section
from edge_agent.synthetic import SyntheticTraffic
from edgewire import DictionaryStore, FrameCodec
from edgewire.dictionaries import DEFAULT_DICT_BYTES, train
from edgewire.pb.edgeinfer.v1 import wire_pb2 as pb

KINDS = {
    "ranking": (pb.REQUEST_KIND_RANKING,),
    "text": (pb.REQUEST_KIND_TEXT,),
    "image (JPEG)": (pb.REQUEST_KIND_IMAGE,),
    "structured (ranking + text)": (pb.REQUEST_KIND_RANKING, pb.REQUEST_KIND_TEXT),
    "all kinds": (pb.REQUEST_KIND_RANKING, pb.REQUEST_KIND_TEXT, pb.REQUEST_KIND_IMAGE),
}
BATCH = 100
TRAIN_SEED = 7  # the dictionary is trained on this seed's traffic unless told otherwise


@dataclass
class Row:
    traffic: str
    shape: str
    messages: int
    raw_bytes: int
    zstd_bytes: int
    zstd_dict_bytes: int
    sent_bytes: int  # what the agent sends with its defaults (dictionary, raw when zstd saves < 10%)

    @property
    def saved(self) -> float:
        return 1 - self.zstd_bytes / self.raw_bytes

    @property
    def saved_dict(self) -> float:
        return 1 - self.zstd_dict_bytes / self.raw_bytes

    @property
    def saved_sent(self) -> float:
        return 1 - self.sent_bytes / self.raw_bytes


def measure(n_requests: int, seed: int, train_seed: int) -> tuple[list[Row], int, float]:
    train_set = SyntheticTraffic(train_seed).take(max(1000, n_requests // 2))
    samples = [
        pb.RequestBatch(requests=[r.request]).SerializeToString()
        for r in train_set
        if r.request.kind != pb.REQUEST_KIND_IMAGE  # JPEG bytes only dilute a dictionary
    ]
    store = DictionaryStore()
    dict_id = store.add(train(samples, DEFAULT_DICT_BYTES))
    # zstd's own result (min_saving 0: raw only where zstd would grow the payload), and the agent's defaults
    plain = FrameCodec(compress_min_bytes=0, min_saving=0.0)
    with_dict = FrameCodec(dictionaries=store, compress_min_bytes=0, min_saving=0.0)
    agent = FrameCodec(dictionaries=store)
    requests = [r.request for r in SyntheticTraffic(seed).take(n_requests)]
    rows = []
    envelope_bytes = 0
    for label, kinds in KINDS.items():
        chosen = [r for r in requests if r.kind in kinds]
        for shape, payloads in (
            ("single", [pb.RequestBatch(requests=[r]) for r in chosen]),
            (
                f"batch of {BATCH}",
                [
                    pb.RequestBatch(requests=chosen[i : i + BATCH])
                    for i in range(0, len(chosen) - BATCH + 1, BATCH)
                ],
            ),
        ):
            if not payloads:
                continue
            raw = z = zd = sent = 0
            for payload in payloads:
                header, body = plain.encode(payload, dict_id=0, agent_id="edge-us-west-1", region="us-west")
                raw += payload.ByteSize()
                z += len(body)
                zd += len(with_dict.encode(payload, dict_id=dict_id)[1])
                sent += len(agent.encode(payload, dict_id=dict_id)[1])
                envelope_bytes = max(envelope_bytes, len(header))
            rows.append(Row(label, shape, len(payloads), raw, z, zd, sent))
    return rows, envelope_bytes, len(store.raw(dict_id) or b"") / 1024


def command(args: argparse.Namespace) -> str:
    """The command line of this run, as it ran: ``--write`` only when it was given."""
    words = ["python -m bench.compression", f"--requests {args.requests}", f"--seed {args.seed}"]
    if args.train_seed != TRAIN_SEED:
        words.append(f"--train-seed {args.train_seed}")
    if args.write:
        words.append("--write")
    return " ".join(words)


def render(rows: list[Row], envelope_bytes: int, dict_kib: float, args: argparse.Namespace) -> str:
    body = [
        "## Compression (issue 2)",
        "",
        f"Command: `{command(args)}`  ",
        f"Measured {stamp()} on {machine()}.  ",
        f"Dictionary: {dict_kib:.0f} KiB, trained on seed {args.train_seed} traffic (single ranking and text "
        f"requests), measured on seed {args.seed}.",
        f"Envelope frame: at most {envelope_bytes} bytes, never compressed. The zstd columns are zstd's "
        "frame, or the payload itself where zstd would make it larger; 'sent' is what the agent sends with "
        "its defaults: the dictionary, payloads under 96 bytes and those zstd shrinks by less than 10% "
        "uncompressed.",
        "",
        table(
            [
                "traffic",
                "payload",
                "messages",
                "raw protobuf",
                "zstd 3",
                "saved",
                "zstd 3 + dict",
                "saved",
                "sent",
                "saved",
            ],
            [
                [
                    r.traffic,
                    r.shape,
                    str(r.messages),
                    f"{r.raw_bytes:,}",
                    f"{r.zstd_bytes:,}",
                    f"{r.saved:.1%}",
                    f"{r.zstd_dict_bytes:,}",
                    f"{r.saved_dict:.1%}",
                    f"{r.sent_bytes:,}",
                    f"{r.saved_sent:.1%}",
                ]
                for r in rows
            ],
        ),
        "",
        "Reading it: ranking requests repeat popular items' ids and catalog features across requests,",
        "so a batch or a dictionary finds them; short text queries gain only from a dictionary (a 100-byte",
        "message holds a 16-byte random request id and a 9-byte zstd frame header); JPEG bytes are already",
        "entropy-coded and do not shrink, which is why 'all kinds' by bytes trails 'structured', and why the",
        "agent sends them uncompressed (no saving worth Hong Kong's decompression).",
    ]
    return "\n".join(body)


def parser() -> argparse.ArgumentParser:
    """The command line: sizes of this many requests of one seed, with a dictionary of another's."""
    cli = argparse.ArgumentParser(description="raw protobuf vs zstd 3 vs zstd 3 + dictionary")
    cli.add_argument("--requests", type=int, default=4000)
    cli.add_argument("--seed", type=int, default=8)
    cli.add_argument("--train-seed", type=int, default=TRAIN_SEED)
    cli.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    cli.add_argument("--json", action="store_true")
    return cli


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows, envelope_bytes, dict_kib = measure(args.requests, args.seed, args.train_seed)
    if args.json:
        extra = [{"saved": r.saved, "saved_dict": r.saved_dict, "saved_sent": r.saved_sent} for r in rows]
        print(json.dumps([asdict(r) | e for r, e in zip(rows, extra, strict=True)], indent=2))
    else:
        print(render(rows, envelope_bytes, dict_kib, args))
    if args.write:
        update_section("compression", render(rows, envelope_bytes, dict_kib, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
