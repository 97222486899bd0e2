"""Actuators: what turns the planner's worker count into workers. One interface, three kinds.

- local processes: `ferry up --autoscale` (launch/autoscale.py), which starts and drains `ferry worker`s;
- Kubernetes: patches a Deployment's `replicas` through the API server's scale subresource. The pods a
  scale-in removes get the worker's preStop drain and a grace period above it (deploy/kubernetes/);
- none: only the `ferry_planner_desired_workers` gauge, for KEDA or another autoscaler to act on.

Every actuator scales in by draining: the worker leaves routing, finishes its streams and exits 0.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from typing import Protocol

import httpx

log = logging.getLogger("ferry.planner")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Actuator(Protocol):
    """Makes the number of workers what the planner decided."""

    async def scale(self, desired: int) -> None:
        """Ask for `desired` workers (starting new ones or draining some)."""
        ...

    def starting(self, registered: int) -> int:
        """Workers asked for that are not registered yet (`registered` live in the registry now)."""
        ...


class GaugeOnly:
    """Acts on nothing: the desired count is only published as a metric (KEDA reads it)."""

    def __init__(self) -> None:
        self._desired: int | None = None

    async def scale(self, desired: int) -> None:
        """Remember the count; the planner sets the gauge."""
        self._desired = desired

    def starting(self, registered: int) -> int:
        """Workers asked for beyond those registered: someone else is starting them, and until they come the
        planner must keep asking for them (a gauge that fell back while they start would undo the scale-out)."""
        return 0 if self._desired is None else max(0, self._desired - registered)


class KubernetesDeployment:
    """Sets `spec.replicas` of one Deployment through the scale subresource, with a merge patch."""

    def __init__(self, client: httpx.AsyncClient, api: str, namespace: str, deployment: str) -> None:
        self._client = client
        self._url = f"{api.rstrip('/')}/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"
        self._desired: int | None = None

    @staticmethod
    def in_cluster(namespace: str, deployment: str, api: str = "") -> KubernetesDeployment:
        """The API server and credentials a pod's service account gives (or `api` without credentials)."""
        headers: dict[str, str] = {}
        verify: ssl.SSLContext | bool = True
        if not api:
            host, port = (
                os.environ["KUBERNETES_SERVICE_HOST"],
                os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
            )
            api = f"https://{host}:{port}"
            headers["Authorization"] = f"Bearer {(SERVICE_ACCOUNT / 'token').read_text().strip()}"
            verify = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
            if not namespace:
                namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        client = httpx.AsyncClient(headers=headers, verify=verify, timeout=10.0)
        return KubernetesDeployment(client, api, namespace or "default", deployment)

    async def replicas(self) -> tuple[int, int]:
        """(spec.replicas, status.replicas) as the API server has them."""
        r = await self._client.get(self._url)
        r.raise_for_status()
        body = r.json()
        return int(body["spec"].get("replicas", 0)), int(body.get("status", {}).get("replicas", 0))

    async def scale(self, desired: int) -> None:
        """PATCH the scale subresource; Kubernetes drains the pods it removes (preStop, SIGTERM)."""
        r = await self._client.patch(
            self._url,
            json={"spec": {"replicas": desired}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        r.raise_for_status()
        self._desired = desired
        log.info("planner: deployment scale set to %d replicas", desired)

    def starting(self, registered: int) -> int:
        """Replicas asked for beyond the workers registered (pods scheduling or loading the model)."""
        return 0 if self._desired is None else max(0, self._desired - registered)

    async def close(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()
