"""Compiles .proto files with the system protoc and grpc_cpp_plugin."""

def cc_grpc_proto(name, srcs, deps = [], **kwargs):
    """C++ messages and gRPC stubs for `srcs`, as one cc_library `name`.

    Paths are relative to the package (proto/), which is the import root.
    """
    pkg = native.package_name()
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs,
        cmd = ("protoc --proto_path={pkg} --cpp_out=$(GENDIR)/{pkg} " +
               "--grpc_out=$(GENDIR)/{pkg} " +
               "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) $(SRCS)").format(pkg = pkg),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        deps = deps + ["@system//:grpc", "@system//:protobuf"],
        **kwargs
    )
