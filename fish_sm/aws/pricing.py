"""What an instance costs: the on-demand hourly price of a SageMaker instance type for
real-time inference, from the AWS Price List (Pricing) API.

The Pricing API answers only in a few regions (us-east-1 among them) whatever region the
instance runs in, so its client is always us-east-1's; the region is a filter. SageMaker lists
one product per instance type, region and component (hosting, training, notebooks, ...); a
real-time endpoint is billed as hosting, so only those count.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fish_sm.aws import AWSError
from fish_sm.aws.session import AWS, error_code

PRICING_REGION = "us-east-1"
SERVICE_CODE = "AmazonSageMaker"
# How the price list names a real-time endpoint's instance hours: the "component" attribute,
# or failing that a usage type such as "USE1-Host:ml.g5.xlarge".
INFERENCE_COMPONENTS = ("hosting", "inference", "real-time inference")
_HOST_USAGE = re.compile(r"(^|-)Host(ing)?:", re.IGNORECASE)


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    instance_type: str
    region: str
    description: str  # the price list's own words, e.g. "$1.41 per Hour for Host:ml.g5.xlarge in US East"


def _is_inference(attributes: dict) -> bool:
    component = str(attributes.get("component", "")).strip().lower()
    return component in INFERENCE_COMPONENTS or bool(_HOST_USAGE.search(str(attributes.get("usagetype", ""))))


def _hourly_usd(product: dict) -> list[tuple[float, str]]:
    """(USD per hour, description) of each on-demand price dimension billed by the hour."""
    out = []
    for term in product.get("terms", {}).get("OnDemand", {}).values():
        for dim in term.get("priceDimensions", {}).values():
            usd = dim.get("pricePerUnit", {}).get("USD")
            if usd is None or not str(dim.get("unit", "")).lower().startswith("hr"):
                continue
            try:
                out.append((float(usd), str(dim.get("description", ""))))
            except ValueError:
                continue
    return out


def on_demand_price(aws: AWS, instance_type: str, region: str) -> Price:
    """The on-demand USD per hour of `instance_type` (ml.g5.xlarge) hosting an endpoint in
    `region`; AWSError (one line) when the price list has none or cannot be read."""
    client = aws.client("pricing", region=PRICING_REGION)
    filters = [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": instance_type},
               {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region}]
    found: list[tuple[float, str]] = []
    token = None
    try:
        while True:
            kwargs = {"ServiceCode": SERVICE_CODE, "Filters": filters, "FormatVersion": "aws_v1", "MaxResults": 100}
            if token:
                kwargs["NextToken"] = token
            page = client.get_products(**kwargs)
            for item in page.get("PriceList", []):
                product = json.loads(item) if isinstance(item, str) else item
                if _is_inference(product.get("product", {}).get("attributes", {})):
                    found += [p for p in _hourly_usd(product) if p[0] > 0]
            token = page.get("NextToken")
            if not token:
                break
    except ValueError as exc:  # a price list entry that is not JSON
        raise AWSError(f"the AWS price list answered something unreadable for {instance_type}: {exc}") from None
    except Exception as exc:
        if error_code(exc) in ("AccessDeniedException", "AccessDenied", "UnauthorizedOperation"):
            raise AWSError(f"cannot read {instance_type}'s price: pricing:GetProducts is denied to these credentials; "
                           "pass --price USD_PER_HOUR") from None
        raise
    if not found:
        raise AWSError(f"the AWS price list has no on-demand inference price for {instance_type} in {region}; "
                       "pass --price USD_PER_HOUR")
    usd, description = max(found)  # several listings of one hosting hour: the dearest, never an understatement
    return Price(usd, instance_type, region, description)


def usd_per_audio_hour(usd_per_hour: float | None, audio_hours_per_instance_hour: float | None) -> float | None:
    """What an hour of audio costs on an instance billed `usd_per_hour` that makes that much audio
    an hour; None when either is unknown or nothing was made."""
    if usd_per_hour is None or not audio_hours_per_instance_hour:
        return None
    return usd_per_hour / audio_hours_per_instance_hour
