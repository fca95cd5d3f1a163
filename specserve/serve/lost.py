"""What a Serve handle call raises when the replica behind it is gone (died, killed, its node
lost, or stopped by a redeploy past its graceful shutdown), rather than when the call itself
failed: the ingress continues a generation elsewhere (continuation.py) and asks a store again
(response_store.py, `store_call`). Light on purpose: the stores' replicas import it."""
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, WorkerCrashedError, NodeDiedError,
        ObjectLostError)
