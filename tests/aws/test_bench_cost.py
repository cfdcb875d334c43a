"""`fish-sm bench` in dollars per audio-hour: each level's cost from the instance's price and the
audio it made, the cheapest passing level, the price from --price or the Pricing API (botocore's
Stubber against the real service model: moto has no Pricing API), and end to end against the
session's real tiny server, into the table, bench.json and bench.html."""

import json

import boto3
import pytest
from botocore.stub import Stubber
from click.testing import CliRunner

from fish_sm.aws.session import AWS
from fish_sm.cli import main
from fish_sm.cli.capacity import instance_price
from fish_sm.clients.bench import bench_cost
from fish_sm.clients.report import format_table, verdict_lines


def level(concurrency, audio_per_s, passed=True):
    return {"concurrency": concurrency, "requests": 4, "ok": 4 if passed else 0, "rejected": 0, "errors": {},
            "error_rate": 0.0 if passed else 1.0, "rps": 1.0, "audio_seconds_per_wall_second": audio_per_s,
            "latency_s": {"p50": 1.0, "p95": 1.0, "p99": 1.0}, "rtf": {"p50": 0.1}, "passed": passed,
            "warnings": []}


def test_cost_per_level_and_the_cheapest_passing_one():
    levels = [level(1, 2.0), level(4, 8.0), level(16, 20.0, passed=False)]
    cost = bench_cost(levels, {"usd_per_hour": 4.0, "source": "--price"}, instances=2, instance_type="ml.g5.xlarge")
    # 2 instances at $4/h make 8 audio-seconds a second: 4 audio-hours per instance-hour, $1 each.
    assert [lv["usd_per_audio_hour"] for lv in levels] == [4.0, 1.0, 0.4]
    assert cost == {"instance_type": "ml.g5.xlarge", "instances": 2, "usd_per_hour": 4.0, "price_source": "--price",
                    "usd_per_audio_hour": 1.0, "at_concurrency": 4}  # the failed level does not count
    report = {"levels": levels, "cost": cost, "notes": [], "settings": {"max_error_rate": 0.0}}
    header, _, *rows = format_table(report).splitlines()
    assert header.split()[-3] == "$/audio-h" and rows[1].split()[-3] == "1.0000"
    assert ("cost: $1.0000 per audio-hour at concurrency 4 (2 x ml.g5.xlarge at $4/h each, --price); closed-loop "
            "load, not under a latency SLO: `fish-sm capacity` gives that") in verdict_lines(report)
    unpriced = bench_cost([level(1, 2.0)], None)
    assert unpriced["usd_per_audio_hour"] is None and "$/audio-h" not in format_table(
        {"levels": [level(1, 2.0)], "cost": unpriced})


def test_price_of_the_instance_type_from_the_pricing_api():
    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="eu-west-1")
    aws = AWS(region="eu-west-1")
    aws._session = session
    client = aws._clients[("pricing", "us-east-1")] = session.client("pricing", region_name="us-east-1")
    product = json.dumps({"product": {"attributes": {"instanceType": "ml.g5.xlarge", "component": "Hosting",
                                                     "usagetype": "EU-Host:ml.g5.xlarge"}},
                          "terms": {"OnDemand": {"t": {"priceDimensions": {"d": {
                              "unit": "Hrs", "pricePerUnit": {"USD": "1.5810000000"},
                              "description": "$1.581 per Hour for EU-Host:ml.g5.xlarge"}}}}}})
    with Stubber(client) as stub:
        stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [product]}, {
            "ServiceCode": "AmazonSageMaker", "FormatVersion": "aws_v1", "MaxResults": 100,
            "Filters": [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": "ml.g5.xlarge"},
                        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "eu-west-1"}]})
        notes = []
        price = instance_price(aws, "ml.g5.xlarge", None, notes)
    assert price["usd_per_hour"] == pytest.approx(1.581) and "on-demand ml.g5.xlarge in eu-west-1" in price["source"]
    assert notes == [] and instance_price(aws, None, 2.5, notes) == {"usd_per_hour": 2.5, "source": "--price"}
    assert instance_price(aws, None, None, notes) is None and notes[0].startswith("no price: pass --price")


@pytest.mark.integration
def test_bench_reports_dollars_per_audio_hour(tiny_url, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["bench", "--url", tiny_url, "--concurrency", "1,2", "--requests", "2",
                                       "--max-new-tokens", "8", "--seed", "0", "--warmup", "0", "--instance-type",
                                       "ml.g5.xlarge", "--price", "1.2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    cost = report["cost"]
    assert cost["instance_type"] == "ml.g5.xlarge" and cost["usd_per_hour"] == 1.2 and cost["price_source"] == "--price"
    for lv in report["levels"]:
        assert lv["usd_per_audio_hour"] == pytest.approx(1.2 / lv["audio_seconds_per_wall_second"])
    assert cost["usd_per_audio_hour"] == min(lv["usd_per_audio_hour"] for lv in report["levels"])
    assert f"cost: ${cost['usd_per_audio_hour']:.4f} per audio-hour at concurrency {cost['at_concurrency']}" \
        in result.output and "$/audio-h" in result.output
    page = (out / "bench.html").read_text()
    assert "<th>$/audio-h</th>" in page and f"${cost['usd_per_audio_hour']:.4f} per audio-hour" in page
