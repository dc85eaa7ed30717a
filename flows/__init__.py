"""insight-queue Prefect flows: the gateway client, generators, scopes and the consumer."""
