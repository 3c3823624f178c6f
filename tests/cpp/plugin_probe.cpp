// plugin_probe.cpp -- drives the built libmtp_trt_plugins.so on the host, the way TensorRT's builder
// would, without TensorRT's library or a GPU: dlopen, getCreators, createPlugin, the build and
// runtime capabilities.  Prints one JSON object per line for tests/test_cpp_probe.py, which
// compares it with mtp_trt/ops.py and plugins/trt_plugins.py.  Compiled by that test with g++
// against TensorRT's headers (only virtual calls into the library: nothing of TensorRT is linked).
//
//   plugin_probe LIB                     creators, fields, serialization, aliases, types, formats
//   plugin_probe LIB ws B0 B1 S0 S1 H Dl T  MlaGenerationAttention's getWorkspaceSize for those ranges
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;
using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);

namespace {

IPluginCreatorV3One* find(GetCreators get, const char* name) {
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = get(n);
    for (int32_t i = 0; i < n; ++i) {
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        if (std::strcmp(c->getPluginName(), name) == 0) return c;
    }
    return nullptr;
}

const char* type_name(PluginFieldType t) {
    return t == PluginFieldType::kINT32 ? "INT32" : t == PluginFieldType::kFLOAT32 ? "FLOAT32" : "OTHER";
}

void print_fields(const PluginFieldCollection* fc) {
    std::printf("[");
    for (int32_t i = 0; fc && i < fc->nbFields; ++i) {
        const PluginField& f = fc->fields[i];
        double v = 0;
        if (f.data) v = f.type == PluginFieldType::kINT32 ? *static_cast<const int32_t*>(f.data)
                                                          : *static_cast<const float*>(f.data);
        std::printf("%s[\"%s\", \"%s\", %d, %.9g]", i ? ", " : "", f.name, type_name(f.type), f.length, v);
    }
    std::printf("]");
}

DynamicPluginTensorDesc desc(DataType t, std::vector<int64_t> lo, std::vector<int64_t> hi) {
    DynamicPluginTensorDesc d{};
    d.desc.type = t;
    d.desc.format = TensorFormat::kLINEAR;
    d.desc.dims.nbDims = d.min.nbDims = d.max.nbDims = d.opt.nbDims = static_cast<int32_t>(lo.size());
    for (size_t i = 0; i < lo.size(); ++i) {
        d.min.d[i] = d.opt.d[i] = lo[i];
        d.max.d[i] = d.desc.dims.d[i] = hi[i];
    }
    return d;
}

struct Plugin {
    IPluginV3* p;
    IPluginV3OneCore* core() { return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE)); }
    IPluginV3OneBuildV2* build() {
        return static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    }
    IPluginV3OneRuntime* runtime() {
        return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    }
};

IPluginV3* make(IPluginCreatorV3One* c, const std::vector<PluginField>& fields) {
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    return c->createPlugin("probe", &fc, TensorRTPhase::kBUILD);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        std::fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    auto get = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
    if (!get || !dlsym(lib, "setLoggerFinder")) return 1;
    const int32_t dl = 32, ts = 90, te = 91;
    const float scale = 0.125f;
    IPluginCreatorV3One* mla = find(get, "MlaGenerationAttention");
    IPluginCreatorV3One* acc = find(get, "MtpAccept");
    if (!mla || !acc) return 1;
    Plugin m{make(mla, {{"kv_lora_rank", &dl, PluginFieldType::kINT32, 1}, {"softmax_scale", &scale, PluginFieldType::kFLOAT32, 1}})};
    if (!m.p) return 1;

    if (argc == 10 && std::string(argv[2]) == "ws") {  // workspace for the given ranges
        auto a = [&](int i) { return std::atoll(argv[i]); };
        const int64_t b0 = a(3), b1 = a(4), s0 = a(5), s1 = a(6), H = a(7), Dl = a(8), T = a(9);
        Plugin w{make(mla, {{"kv_lora_rank", &Dl, PluginFieldType::kINT64, 1}, {"softmax_scale", &scale, PluginFieldType::kFLOAT32, 1}})};
        const int64_t D = Dl + 16;
        DynamicPluginTensorDesc in[] = {desc(DataType::kHALF, {b0, s0, H, D}, {b1, s1, H, D}),
                                        desc(DataType::kHALF, {b0, s0, D}, {b1, s1, D}),
                                        desc(DataType::kHALF, {b0, 1, D}, {b1, T, D}), desc(DataType::kINT32, {b0}, {b1})};
        DynamicPluginTensorDesc out[] = {desc(DataType::kHALF, {b0, s0, H, Dl}, {b1, s1, H, Dl}),
                                         desc(DataType::kHALF, {b0, 1, D}, {b1, T, D})};
        std::printf("%zu\n", w.build()->getWorkspaceSize(in, 4, out, 2));
        return 0;
    }

    Plugin a{make(acc, {{"think_start_id", &ts, PluginFieldType::kINT32, 1}, {"think_end_id", &te, PluginFieldType::kINT32, 1}})};
    for (auto [c, pl] : {std::pair{mla, m}, std::pair{acc, a}}) {
        std::printf("{\"op\": \"%s\", \"version\": \"%s\", \"namespace\": \"%s\", \"field_names\": ", c->getPluginName(),
                    c->getPluginVersion(), c->getPluginNamespace());
        print_fields(c->getFieldNames());
        std::printf(", \"core\": [\"%s\", \"%s\", \"%s\"], \"serialized\": ", pl.core()->getPluginName(),
                    pl.core()->getPluginVersion(), pl.core()->getPluginNamespace());
        IPluginV3* clone = pl.runtime()->attachToContext(nullptr);  // the runtime's copy serializes the same
        print_fields(Plugin{clone}.runtime()->getFieldsToSerialize());
        delete clone;
        const int32_t n = pl.build()->getNbOutputs();
        std::printf(", \"num_outputs\": %d, \"aliases\": [", n);
        for (int32_t i = 0; i < n; ++i) std::printf("%s%d", i ? ", " : "", pl.build()->getAliasedInput(i));
        std::printf("]");
        // output types for each float input type (attention) / the fixed types (accept)
        std::printf(", \"output_types\": [");
        for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
            DataType ins[5] = {t, t, t, DataType::kINT32, DataType::kFLOAT}, outs[3];
            if (c == acc) ins[0] = DataType::kFLOAT, ins[1] = ins[2] = ins[3] = DataType::kINT32;
            const int32_t rc = pl.build()->getOutputDataTypes(outs, n, ins, c == mla ? 4 : 5);
            std::printf("%s[%d", t == DataType::kFLOAT ? "" : ", ", rc);
            for (int32_t i = 0; i < n; ++i) std::printf(", %d", static_cast<int>(outs[i]));
            std::printf("]");
        }
        // supportsFormatCombination: every position with each of float, half, bf16, int32 (others at type 0's)
        std::printf("], \"formats\": [");
        const int32_t nin = c == mla ? 4 : 5;
        for (int32_t pos = 0; pos < nin + n; ++pos) {
            std::printf("%s[", pos ? ", " : "");
            int k = 0;
            for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT32}) {
                std::vector<DynamicPluginTensorDesc> io(nin + n, desc(DataType::kHALF, {1}, {1}));
                if (c == acc) {  // the valid types, then one position changed
                    const DataType ok[] = {DataType::kFLOAT, DataType::kINT32, DataType::kINT32, DataType::kINT32,
                                           DataType::kFLOAT, DataType::kINT32, DataType::kINT32, DataType::kINT32};
                    for (int32_t i = 0; i < nin + n; ++i) io[i].desc.type = ok[i];
                } else {
                    io[3].desc.type = DataType::kINT32;
                }
                io[pos].desc.type = t;
                std::printf("%s%d", k++ ? ", " : "", pl.build()->supportsFormatCombination(pos, io.data(), nin, n) ? 1 : 0);
            }
            std::printf("]");
        }
        std::printf("]}\n");
    }
    const int32_t zero = 0;
    std::printf("{\"bad_kv_lora_rank\": %d, \"missing_field\": %d}\n",
                make(mla, {{"kv_lora_rank", &zero, PluginFieldType::kINT32, 1}, {"softmax_scale", &scale, PluginFieldType::kFLOAT32, 1}}) == nullptr,
                make(mla, {{"kv_lora_rank", &dl, PluginFieldType::kINT32, 1}}) == nullptr);
    delete m.p;
    delete a.p;
    return 0;
}
