"""The gateway feeds routing: observed latencies calibrate the cost model; a MaxMind database is opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.server import GatewayStartError
from gateway.testing import WireClient, run_gateway
from tests.gateway.daemon.test_serving import synthetic
from tests.routing.test_geo import country_record, write_db


async def test_served_batches_calibrate_the_routing_cost_model(models_dir: Path) -> None:
    """After traffic, the routing calibrator holds latency estimates for the models served."""
    async with run_gateway(models_dir=models_dir) as gw:
        async with WireClient(gw.endpoint("hgc")) as agent:
            await agent.infer(synthetic(60, seed=71))
        snapshot = gw.policy.policy.calibrator.snapshot()
    assert {model for model, _ in snapshot} >= {"rank-mlp", "text-encoder"}


async def test_geoip_database_is_opened_for_peer_regions(models_dir: Path, tmp_path: Path) -> None:
    """routing.geoip_db is read with geoip2 at start; peer addresses then resolve through it."""
    db = write_db(tmp_path / "country.mmdb", "GeoLite2-Country", {"81.2.69.0/24": country_record("EU", "GB")})
    async with run_gateway(models_dir=models_dir, routing={"geoip_db": str(db)}) as gw:
        assert gw.ingest is not None
        assert gw.ingest.regions.resolve("", "81.2.69.160:40000") == "eu-west"


async def test_unreadable_geoip_database_is_a_start_error(models_dir: Path, tmp_path: Path) -> None:
    """A configured database that cannot be opened stops the start with the key named."""
    with pytest.raises(GatewayStartError, match=r"routing\.geoip_db"):
        async with run_gateway(models_dir=models_dir, routing={"geoip_db": str(tmp_path / "missing.mmdb")}):
            pass
