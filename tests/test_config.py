"""Flags declared once (specinfer.config): argv parses into a frozen config, the config turns
back into the same argv, a bad value is refused naming its flag, and ``up`` starts each
service with the values declared for it."""

from __future__ import annotations

import dataclasses

import pytest

from services.router.config import RouterConfig
from services.speculator.config import SpeculatorConfig
from services.stack import UpConfig, service_command
from services.verifier.config import VerifierConfig
from specinfer.config import Flags, parse, to_argv
from specinfer.models import ModelError
from specinfer.tls import TlsError

ARGV = {
    VerifierConfig: ["--llm", "m", "--port", "7", "--slots", "3", "--no-compile", "--dtype",
                     "bfloat16", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--head-nodes",
                     "5", "--sequence-lease", "0", "--node-rank", "1"],
    SpeculatorConfig: ["--ssm", "a", "--ssm", "b#layers=1", "--no-ngram", "--expansion",
                       "1,0,2", "--metrics-port", "9100"],
    RouterConfig: ["--verifier", "v:1", "--verifier", "w:2", "--discovery", "dns",
                   "--discovery-interval", "3", "--speculation", "always", "--max-n", "2",
                   "--api-key", "k1", "--metrics-auth", "--speculate-timeout", "0.5"],
}


def values(config: Flags) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@pytest.mark.parametrize("cls", list(ARGV))
def test_argv_parses_into_the_config_and_back(cls):
    config = parse(cls, ARGV[cls])
    assert dataclasses.is_dataclass(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.llm = "other"
    assert parse(cls, to_argv(cls, values(config))) == config
    assert to_argv(cls, {}) == []  # nothing given: no flag, the service's defaults


def test_parsed_values_have_their_types():
    v = parse(VerifierConfig, ARGV[VerifierConfig])
    assert (v.port, v.slots, v.sequence_lease, v.node_rank) == (7, 3, 0.0, 1)
    assert (v.placement.compile, v.placement.dtype) == ("off", "bfloat16")  # --no-compile
    assert (v.tls.tls_cert, v.tls.tls_ca, v.master_port) == ("c.pem", None, None)
    assert v.head_widths() == (2, 1, 1, 1)
    s = parse(SpeculatorConfig, ARGV[SpeculatorConfig])
    assert (s.ssm, s.no_ngram, s.expansion_widths()) == (("a", "b#layers=1"), True, [1, 0, 2])
    assert parse(SpeculatorConfig, []) == SpeculatorConfig()  # argparse's defaults are ours
    assert SpeculatorConfig().ssm is None  # the bundled pool
    r = parse(RouterConfig, ARGV[RouterConfig])
    assert (r.verifier, r.speculator, r.api_key) == (("v:1", "w:2"), (), ("k1",))
    assert (r.discovery.mode, r.discovery.interval, r.limits.max_n) == ("dns", "3", 2)
    assert (r.speculate_timeout, r.metrics_auth) == (0.5, True)


@pytest.mark.parametrize("cls,argv,message", [
    (VerifierConfig, ["--sequence-lease", "-1"], "--sequence-lease must be >= 0 seconds; got -1.0"),
    (VerifierConfig, ["--drain-timeout", "-2"], "--drain-timeout must be >= 0 seconds"),
    (VerifierConfig, ["--rank-timeout", "0"], "--rank-timeout must be > 0 seconds; got 0.0"),
    (VerifierConfig, ["--head-nodes", "65"], r"--head-nodes must be in 1..--max-tree-nodes"),
    (VerifierConfig, ["--head-expansion", "1,x"], "--head-expansion must list tree widths"),
    (SpeculatorConfig, ["--expansion", "1,17"], "--expansion must list tree widths in 0..16"),
    (RouterConfig, ["--verifier", "a:1", "--max-n", "0"], "--max-n must be >= 1; got 0"),
    (RouterConfig, ["--verifier", "a:1", "--max-logprobs", "99"], "--max-logprobs must be <= "),
    (RouterConfig, ["--verifier", "a:1", "--speculate-timeout", "0"],
     "--speculate-timeout must be > 0 seconds"),
    (UpConfig, ["--verifiers", "0"], "--verifiers must be >= 1; got 0"),
    (UpConfig, ["--expansion", "9,99"], "--expansion must list"),  # the speculator's check
    (UpConfig, ["--speculate-timeout", "-1"], "--speculate-timeout must be > 0"),  # the router's
])
def test_a_bad_value_is_refused_naming_its_flag(cls, argv, message):
    with pytest.raises(ModelError, match=message):
        parse(cls, argv)


def test_choices_are_checked_when_made_too():
    with pytest.raises(ModelError, match="--head-tree must be one of dynamic, static; got 'x'"):
        VerifierConfig(head_tree="x")
    with pytest.raises(SystemExit):  # on the command line, argparse's usage error
        parse(RouterConfig, ["--verifier", "a:1", "--speculate-rpc", "x"])


def test_up_starts_each_service_with_the_values_declared_for_it():
    up = parse(UpConfig, ["--llm", "m", "--ssm", "s1", "--slots", "5", "--max-context", "512",
                          "--datastore", "none", "--port", "50051", "--speculation", "always",
                          "--dtype", "bfloat16", "--api-key", "secret", "--metrics-auth",
                          "--otlp-traces-endpoint", "http://otel:4317"])

    def started(role: str, cls: type[Flags], **extra) -> Flags:
        cmd = service_command(up, role, **extra)
        assert cmd[3:5] == ["serve", role]
        assert "secret" not in cmd  # keys reach the router in its environment
        return parse(cls, cmd[5:])

    v = started("verifier", VerifierConfig, port=7, threads=2)
    assert (v.llm, v.slots, v.max_context, v.datastore, v.port, v.threads) == \
        ("m", 5, 512, "none", 7, 2)
    assert v.placement.dtype == "bfloat16" and v.otlp_traces_endpoint == "http://otel:4317"
    s = started("speculator", SpeculatorConfig, port=8, threads=2)
    assert (s.ssm, s.max_context, s.datastore, s.port) == (("s1",), 512, "none", 8)
    assert s.slots == SpeculatorConfig().slots  # up's --slots is the verifiers'
    r = started("router", RouterConfig, verifier=("127.0.0.1:7",), speculator=("127.0.0.1:8",))
    assert (r.llm, r.port, r.speculation, r.metrics_auth) == ("m", 50051, "always", True)
    assert r.speculate_timeout == RouterConfig().speculate_timeout  # not given: the router's
    assert (r.verifier, r.speculator, r.api_key) == (("127.0.0.1:7",), ("127.0.0.1:8",), ())
    # The router's address is in its command line even at the default port: what
    # service_processes reads back.
    assert "--port" in service_command(up, "router", verifier=("a:1",))


def test_up_refuses_its_own_certificates_beside_tls_files():
    with pytest.raises(TlsError, match="--tls makes its own certificates"):
        parse(UpConfig, ["--tls", "--tls-cert", "c.pem"])
    assert parse(UpConfig, ["--tls"]).throwaway_tls


def test_every_forwarded_field_is_declared_by_its_service():
    """``up``'s value for a field reaches a service only if that service declares it the
    same way: same flag, type and choices."""
    for f in dataclasses.fields(UpConfig):
        for service in f.metadata.get("to", ()):
            declared = {g.name: g for g in dataclasses.fields(service)}[f.name]
            if "flag" in f.metadata:
                ours, theirs = f.metadata["flag"], declared.metadata["flag"]
                assert (ours.flag_name(f.name), ours.type, ours.choices, ours.repeatable) == \
                    (theirs.flag_name(f.name), theirs.type, theirs.choices, theirs.repeatable)
            else:
                assert f.metadata["group"] is declared.metadata["group"]
