"""A microVM pod as PodRuntime (specs/handler.proto) sees it: the pods, their
containers and processes as objects (`pods`, `containers`, `processes`,
`registry`), their records, the binds each container gets (`mount_plan`,
`container_spec`), the guest's memory sized to the pod, its network and TCP
forwarding, and the gRPC and ttrpc services that serve it."""
