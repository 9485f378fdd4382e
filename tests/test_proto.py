"""The committed protobuf stubs match the protos, and the tree wire format round-trips."""

import filecmp
import subprocess
import sys
from pathlib import Path

from specinfer.tree import ROOT, Draft, TokenTree
from specinfer.v1 import common_pb2
from specinfer.wire import tree_from_proto, tree_to_proto

REPO = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_protos(tmp_path):
    protos = sorted(str(p.relative_to(REPO / "proto"))
                    for p in (REPO / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos],
        cwd=REPO, check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    for rel in generated:
        committed = REPO / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert filecmp.cmp(tmp_path / rel, committed, shallow=False), \
            f"{rel} is stale: run `make proto`"


def test_tree_round_trips_through_the_wire_format():
    tree = TokenTree()
    a = tree.add(ROOT, 5, [Draft(0, 0, (5, 7), (0.75, 0.25))])
    tree.add(a, 9, [Draft.one_hot(1, 0, 9)])
    tree.add(ROOT, 7, [Draft(0, 1, (7,), (1.0,)), Draft(2, 0, (7, 8), (0.5, 0.5))])
    msg = tree_to_proto(tree)
    assert isinstance(msg, common_pb2.TokenTree)
    back = tree_from_proto(common_pb2.TokenTree.FromString(msg.SerializeToString()))
    assert back.tokens == tree.tokens and back.parents == tree.parents
    assert back.depths == tree.depths
    for d1, d2 in zip(back.drafts, tree.drafts, strict=True):
        assert [(d.source, d.rank, d.q_ids) for d in d1] == [(d.source, d.rank, d.q_ids)
                                                            for d in d2]
        for x, y in zip(d1, d2, strict=True):
            assert all(abs(p - r) < 1e-7 for p, r in zip(x.q_probs, y.q_probs, strict=True))
