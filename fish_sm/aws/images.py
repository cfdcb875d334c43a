"""Container images in ECR: an --image in a private registry is looked up before anything is
made, so a mistyped tag fails in a second rather than as a Failed endpoint half an hour later."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.session import AWS, error_code

# ACCOUNT.dkr.ecr[-fips].REGION.amazonaws.com[.cn]/REPO(:TAG | @sha256:DIGEST)
_ECR = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/"
                  r"(?P<repo>[a-z0-9][a-z0-9._/-]*?)(?::(?P<tag>[\w][\w.-]{0,127})|@(?P<digest>sha256:[0-9a-f]{64}))?$")
_DENIED = ("AccessDeniedException", "AccessDenied", "403")


@dataclass(frozen=True)
class EcrImage:
    uri: str
    account: str
    region: str
    repository: str
    tag: str | None
    digest: str | None

    def image_id(self) -> dict:
        return {"imageDigest": self.digest} if self.digest else {"imageTag": self.tag or "latest"}


def parse_ecr_uri(uri: str) -> EcrImage | None:
    """The parts of a private ECR image URI; None for any other registry (Docker Hub, ECR Public, ...)."""
    m = _ECR.match(uri or "")
    if m is None:
        return None
    return EcrImage(uri, m["account"], m["region"], m["repo"], m["tag"], m["digest"])


def check_image(aws: AWS, uri: str, log: Log = quiet) -> None:
    """Fail unless a private ECR image exists; other registries, and images these credentials may
    not describe (AWS's own deep learning containers, another account's), are left to SageMaker."""
    image = parse_ecr_uri(uri)
    if image is None:
        return
    try:
        aws.client("ecr", region=image.region).describe_images(
            registryId=image.account, repositoryName=image.repository, imageIds=[image.image_id()])
    except Exception as exc:
        code = error_code(exc)
        if code == "RepositoryNotFoundException":
            raise AWSError(f"--image {uri}: no repository {image.repository!r} in ECR account {image.account}, "
                           f"{image.region}") from None
        if code == "ImageNotFoundException":
            what = f"digest {image.digest}" if image.digest else f"tag {image.tag or 'latest'!r}"
            raise AWSError(f"--image {uri}: repository {image.repository!r} has no image with {what}") from None
        if code in _DENIED:
            log(f"note: cannot check that {uri} exists (ecr:DescribeImages is denied); SageMaker will pull it")
            return
        raise
