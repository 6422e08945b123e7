"""The product's commands (`tokengate …`) and process supervision: flags, the gateway and `serve`
processes, embedded Redis, ordered shutdown."""
