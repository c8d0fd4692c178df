"""A microVM pod as PodRuntime (specs/handler.proto) sees it: its containers
and their processes, its records, the binds each container gets (`mount_plan`,
`container_spec`, `share`), its TCP forwarding and the bound on a stop."""
