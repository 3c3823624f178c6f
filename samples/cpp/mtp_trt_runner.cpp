// mtp_trt_runner.cpp -- the reference for embedding mtp-trt engines in a C++ program: greedy MTP
// speculative decoding (eagle mode) of one prompt of token ids with the engines of `mtp-trt build`.
//
//   mtp_trt_runner ENGINE_DIR --ids 1,2,3 [--plugins libmtp_trt_plugins.so] [--max-new-tokens 64]
//                  [--nextn K] [--cuda-graph] [--relaxed-topk N --relaxed-delta D]
//
// Prints the generated ids on stdout and the speed on stderr (tokens/s, mean accepted tokens per
// step).  Bring your own tokenizer: ids in, ids out.  The graph contract is docs/architecture.md's,
// the loop is mtp_trt/decode.py's greedy path (prefill, draft, fused_step) for batch 1:
//
//   prefill : target(prompt, past_len 0) -> first token, hidden states
//             mtp_0 depth 1 over the prompt rows (hidden = target's, next tokens = prompt[1:] + first)
//             mtp_0 depths 2..K one row each (hidden = previous depth's, token = previous draft)
//   step    : step_K([last, d1..dK], past_len) -> accepted tokens, n, next drafts,
//             thinking flag; past_len += n + 1.  Rewinding rejected rows is only this length update:
//             the next step overwrites them.
//
// The latent caches are allocated once; every cache input of an engine and its aliased output
// `<cache>_out` are bound to the same buffer (the plugins write in place).  Which outputs are aliased is
// the graph contract recorded in engines.json ("aliases"); TensorRT 10.15 and later also report it, and
// must agree.  Supported: TensorRT 10.3 (aliased plugin I/O) to 11.x, checked when compiling and at start.  Engine I/O names, types
// and shapes are read from the engines.  The plugins come from libmtp_trt_plugins.so (loaded into
// TensorRT's plugin registry); engines built with the Python plugins run with it too.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.h"

#if NV_TENSORRT_MAJOR < 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR < 3) || NV_TENSORRT_MAJOR > 11
#error "mtp_trt_runner needs TensorRT 10.3 to 11.x (aliased plugin I/O)"
#endif

using namespace nvinfer1;

namespace {

// TensorRT's library (not its headers) is in the supported range: getInferLibVersion() is major*10000 + minor*100
// + patch from 10.0 on.
void check_tensorrt_version() {
    const int32_t v = getInferLibVersion();
    const int32_t major = v / 10000, minor = v / 100 % 100;
    if (major < 10 || (major == 10 && minor < 3) || major > 11)
        throw std::runtime_error("TensorRT " + std::to_string(major) + "." + std::to_string(minor) +
                                 " is not supported: mtp_trt_runner runs TensorRT 10.3 to 11.x");
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

class Logger : public ILogger {
    void log(Severity severity, const char* msg) noexcept override {
        if (severity <= Severity::kWARNING) std::fprintf(stderr, "[TensorRT] %s\n", msg);
    }
};

size_t element_size(DataType t) {
    switch (t) {
        case DataType::kFLOAT: case DataType::kINT32: return 4;
        case DataType::kHALF: case DataType::kBF16: return 2;
        case DataType::kINT64: return 8;
        default: return 1;
    }
}

int64_t volume(const Dims& d) {
    int64_t v = 1;
    for (int i = 0; i < d.nbDims; ++i) v *= d.d[i];
    return v;
}

Dims dims(std::initializer_list<int64_t> ds) {
    Dims d{};
    for (int64_t x : ds) d.d[d.nbDims++] = x;
    return d;
}

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read " + path);
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// An allocation that only grows (its address stays fixed once big enough: CUDA-graph safe): device memory, or
// pinned host memory (asynchronous copies from and to it need no staging).
template <cudaError_t (*Alloc)(void**, size_t), cudaError_t (*Release)(void*)>
struct GrowingBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    void* ensure(size_t n) {
        if (n > bytes) {
            if (ptr) check(Release(ptr), "free");
            check(Alloc(&ptr, n), "allocation");
            bytes = n;
        }
        return ptr;
    }
    GrowingBuffer() = default;
    GrowingBuffer(const GrowingBuffer&) = delete;
    GrowingBuffer& operator=(const GrowingBuffer&) = delete;
    ~GrowingBuffer() {
        if (ptr) Release(ptr);
    }
};
using DeviceBuffer = GrowingBuffer<cudaMalloc, cudaFree>;
using PinnedBuffer = GrowingBuffer<cudaMallocHost, cudaFreeHost>;

struct Tensor {
    void* ptr;
    Dims shape;
};

// One engine with one execution context on one optimization profile.  bind() binds the given
// inputs, every aliased output (engines.json's "aliases": output -> input) to its input's buffer and
// every other output to a buffer of its own.
class Graph {
   public:
    Graph(IRuntime& runtime, const std::string& path, int profile, cudaStream_t stream, const json::Value& aliases) {
        for (const auto& kv : aliases.obj) aliases_[kv.first] = kv.second.as_string();
        const std::string blob = read_file(path);
        engine_.reset(runtime.deserializeCudaEngine(blob.data(), blob.size()));
        if (!engine_) throw std::runtime_error("cannot deserialize " + path + " (plugins loaded? same TensorRT?)");
        ctx_.reset(engine_->createExecutionContext());
        if (!ctx_ || !ctx_->setOptimizationProfileAsync(profile, stream))
            throw std::runtime_error(path + ": cannot create a context on profile " + std::to_string(profile));
        for (int i = 0; i < engine_->getNbIOTensors(); ++i) names_.emplace_back(engine_->getIOTensorName(i));
        for (const auto& n : names_) {
            const bool out = engine_->getTensorIOMode(n.c_str()) == TensorIOMode::kOUTPUT;
            const auto it = aliases_.find(n);
            if (it != aliases_.end() && (!out || !has(it->second)))
                throw std::runtime_error(path + ": engines.json aliases " + n + " to " + it->second +
                                         ", which this engine does not have");
#if NV_TENSORRT_VERSION >= 101500  // TensorRT reports aliased outputs from 10.15: where it does, it must agree
            const char* reported = out ? engine_->getAliasedInputTensor(n.c_str()) : nullptr;
            if (reported && (it == aliases_.end() || it->second != reported))
                throw std::runtime_error(path + ": TensorRT binds " + n + " to " + reported +
                                         ", engines.json does not; build the engines again");
#endif
        }
    }

    bool has(const std::string& name) const { return std::find(names_.begin(), names_.end(), name) != names_.end(); }
    DataType type(const std::string& name) const { return engine_->getTensorDataType(name.c_str()); }
    // A static dimension of a tensor as the engine declares it (e.g. the cache row width).
    int64_t static_dim(const std::string& name, int axis) const { return engine_->getTensorShape(name.c_str()).d[axis]; }
    std::vector<std::string> inputs() const {
        std::vector<std::string> out;
        for (const auto& n : names_)
            if (engine_->getTensorIOMode(n.c_str()) == TensorIOMode::kINPUT) out.push_back(n);
        return out;
    }

    void bind(const std::map<std::string, Tensor>& in) {
        for (const auto& n : names_) {
            if (engine_->getTensorIOMode(n.c_str()) != TensorIOMode::kINPUT) continue;
            auto it = in.find(n);
            if (it == in.end()) throw std::runtime_error("no value for input " + n);
            if (!ctx_->setInputShape(n.c_str(), it->second.shape) || !ctx_->setTensorAddress(n.c_str(), it->second.ptr))
                throw std::runtime_error("cannot bind input " + n);
        }
        for (const auto& n : names_) {
            if (engine_->getTensorIOMode(n.c_str()) != TensorIOMode::kOUTPUT) continue;
            const auto alias = aliases_.find(n);
            void* ptr = alias != aliases_.end()
                            ? in.at(alias->second).ptr
                            : out_[n].ensure(volume(ctx_->getTensorShape(n.c_str())) * element_size(type(n)) + 1);
            if (!ctx_->setTensorAddress(n.c_str(), ptr)) throw std::runtime_error("cannot bind output " + n);
        }
    }
    void enqueue(cudaStream_t stream) {
        if (!ctx_->enqueueV3(stream)) throw std::runtime_error("enqueueV3 failed");
    }
    void* output(const std::string& name) { return out_.at(name).ptr; }

   private:
    std::unique_ptr<ICudaEngine> engine_;
    std::unique_ptr<IExecutionContext> ctx_;
    std::vector<std::string> names_;
    std::map<std::string, std::string> aliases_;
    std::map<std::string, DeviceBuffer> out_;
};

struct Options {
    std::string dir, plugins, ids;
    int max_new_tokens = 64, nextn = -1, relaxed_topk = 0;
    float relaxed_delta = 0.f;
    bool cuda_graph = false;
};

Options parse_args(int argc, char** argv) {
    Options o;
    const char* env = std::getenv("MTP_TRT_PLUGIN_LIB");
    o.plugins = env ? env : "libmtp_trt_plugins.so";
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
            return argv[++i];
        };
        if (a == "--ids") o.ids = next();
        else if (a == "--plugins") o.plugins = next();
        else if (a == "--max-new-tokens") o.max_new_tokens = std::stoi(next());
        else if (a == "--nextn") o.nextn = std::stoi(next());
        else if (a == "--relaxed-topk") o.relaxed_topk = std::stoi(next());
        else if (a == "--relaxed-delta") o.relaxed_delta = std::stof(next());
        else if (a == "--cuda-graph") o.cuda_graph = true;
        else if (o.dir.empty() && a[0] != '-') o.dir = a;
        else throw std::runtime_error("unknown argument " + a);
    }
    if (o.dir.empty() || o.ids.empty())
        throw std::runtime_error("usage: mtp_trt_runner ENGINE_DIR --ids 1,2,3 [--plugins LIB] [--max-new-tokens N] "
                                 "[--nextn K] [--cuda-graph] [--relaxed-topk N --relaxed-delta D]");
    return o;
}

std::vector<int32_t> parse_ids(const std::string& s) {
    std::vector<int32_t> ids;
    std::stringstream ss(s);
    for (std::string tok; std::getline(ss, tok, ',');)
        if (!tok.empty()) ids.push_back(std::stoi(tok));
    if (ids.empty()) throw std::runtime_error("--ids: no token ids");
    return ids;
}

int thinking_after(const std::vector<int32_t>& toks, int flag, int think_start, int think_end) {
    for (int32_t t : toks) flag = t == think_start ? 1 : t == think_end ? 0 : flag;
    return flag;
}

// Small int32/float inputs: host values copied into a pinned twin and uploaded on the stream (asynchronous,
// ordered with the engines).  A name's pinned twin is rewritten only after the stream has drained (the loop
// synchronizes after every call that reads results), so an upload in flight never sees a later value.
struct Scalars {
    cudaStream_t stream;
    std::map<std::string, DeviceBuffer> buf;
    std::map<std::string, PinnedBuffer> host;
    Tensor upload(const std::string& name, const void* v, size_t bytes, Dims shape) {
        void* p = buf[name].ensure(bytes + 4);
        void* h = host[name].ensure(bytes + 4);
        std::memcpy(h, v, bytes);
        check(cudaMemcpyAsync(p, h, bytes, cudaMemcpyHostToDevice, stream), "upload");
        return {p, shape};
    }
    Tensor ints(const std::string& name, const std::vector<int32_t>& v, Dims shape) {
        return upload(name, v.data(), v.size() * 4, shape);
    }
    Tensor f32(const std::string& name, float v) { return upload(name, &v, 4, dims({})); }
};

int run(const Options& opt) {
    const json::Value em = json::parse(read_file(opt.dir + "/engines.json"));
    const json::Value xm = json::parse(read_file(opt.dir + "/export_manifest.json"));
    if (em.has("lowering") && em["lowering"].as_string() != "plugin")
        throw std::runtime_error("this sample runs engines of the plugin lowering (mtp-trt export --lowering plugin)");
    const int export_k = em["export"]["nextn"].as_int();
    const int K = opt.nextn < 0 ? export_k : opt.nextn;
    if (em["export"]["mtp_mode"].as_string() != "eagle" && K > 0)
        throw std::runtime_error("this sample runs eagle-mode engines only (vanilla: use mtp_trt/decode.py, or --nextn 0)");
    if (K > export_k) throw std::runtime_error("--nextn " + std::to_string(K) + " > the export's " + std::to_string(export_k));
    std::vector<int32_t> eos;
    for (const auto& v : xm["eos_ids"].arr) eos.push_back(v.as_int());
    const int think_start = xm["think_ids"].arr.at(0).as_int(), think_end = xm["think_ids"].arr.at(1).as_int();
    const std::vector<int32_t> prompt = parse_ids(opt.ids);
    const int L = static_cast<int>(prompt.size());
    if (L > em["max_prefill"].as_int())
        throw std::runtime_error("prompt of " + std::to_string(L) + " ids > max_prefill " +
                                 std::to_string(em["max_prefill"].as_int()) + " (this sample has no chunked prefill)");
    const int rows = std::min(em["max_seq_len"].as_int(), L + opt.max_new_tokens + 2 * K + 2);  // cache rows

    check_tensorrt_version();
    Logger logger;
    if (!getPluginRegistry()->loadLibrary(opt.plugins.c_str()))
        throw std::runtime_error("cannot load the plugin library " + opt.plugins + " (--plugins / MTP_TRT_PLUGIN_LIB)");
    std::unique_ptr<IRuntime> runtime(createInferRuntime(logger));
    cudaStream_t stream;
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    auto graph = [&](const std::string& name, int profile) {  // profile 0: generation, 1: prefill
        const json::Value& e = em["engines"][name];
        return std::make_unique<Graph>(*runtime, opt.dir + "/" + e["file"].as_string(), profile, stream, e["aliases"]);
    };
    std::unique_ptr<Graph> target = graph("target", 1), step = graph("step_" + std::to_string(K), 0), mtp;
    if (K) mtp = graph("mtp_0", 1);

    // The latent caches, once: kv_<i> of the main model (shared by target and step), kv / mtp_kv of the MTP module.
    std::map<std::string, DeviceBuffer> caches;
    std::map<std::string, Tensor> cache_in;  // input name -> cache tensor, for every graph
    for (const auto& name : step->inputs()) {
        if (name.rfind("kv_", 0) != 0 && name != "mtp_kv") continue;
        const int64_t width = step->static_dim(name, 2);
        const size_t bytes = static_cast<size_t>(rows) * width * element_size(step->type(name));
        cache_in[name] = {caches[name].ensure(bytes), dims({1, rows, width})};
        check(cudaMemset(cache_in[name].ptr, 0, bytes), "cudaMemset");
    }
    if (K) cache_in["kv"] = cache_in.at("mtp_kv");  // the mtp graph's name for the same cache

    Scalars s{stream, {}, {}};
    auto with_caches = [&](std::map<std::string, Tensor> in) {
        in.insert(cache_in.begin(), cache_in.end());
        return in;
    };
    PinnedBuffer fetched;  // prefill's results come back into pinned memory (a true asynchronous copy)
    auto fetch = [&](void* dev, size_t count) {
        int32_t* h = static_cast<int32_t*>(fetched.ensure(count * 4));
        check(cudaMemcpyAsync(h, dev, count * 4, cudaMemcpyDeviceToHost, stream), "download");
        check(cudaStreamSynchronize(stream), "sync");
        return std::vector<int32_t>(h, h + count);
    };

    // ---- prefill --------------------------------------------------------------------------------
    const auto t0 = std::chrono::steady_clock::now();
    int thinking = thinking_after(prompt, 0, think_start, think_end);
    target->bind(with_caches({{"input_ids", s.ints("ids", prompt, dims({1, L}))},
                             {"past_len", s.ints("past", {0}, dims({1}))},
                             {"thinking", s.ints("th", {thinking}, dims({1}))},
                             {"relaxed_topk", s.ints("topk", {0}, dims({}))},
                             {"relaxed_delta", s.f32("delta", 0.f)}}));
    target->enqueue(stream);
    const int32_t first = fetch(target->output("target_tokens"), L)[L - 1];
    std::vector<int32_t> out_ids{first};
    int past_len = L, last = first;
    thinking = thinking_after({first}, thinking, think_start, think_end);
    std::vector<int32_t> drafts(K);
    if (K) {  // eagle drafting over the prompt: depth 1 over rows 0..L-1, depths 2..K one row each
        const DataType ht = mtp->type("hidden");
        const int64_t D = mtp->static_dim("hidden", 2);
        const size_t row_bytes = D * element_size(ht);
        std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
        next.push_back(first);
        mtp->bind(with_caches({{"hidden", {target->output("hidden_states"), dims({1, L, D})}},
                               {"next_tokens", s.ints("next", next, dims({1, L}))},
                               {"past_len", s.ints("past", {0}, dims({1}))}}));
        mtp->enqueue(stream);
        drafts[0] = fetch(mtp->output("draft_tokens"), L)[L - 1];
        DeviceBuffer h;
        h.ensure(row_bytes);
        check(cudaMemcpyAsync(h.ptr, static_cast<char*>(mtp->output("hidden_out")) + (L - 1) * row_bytes, row_bytes,
                              cudaMemcpyDeviceToDevice, stream), "copy hidden");
        for (int depth = 2; depth <= K; ++depth) {
            mtp->bind(with_caches({{"hidden", {h.ptr, dims({1, 1, D})}},
                                   {"next_tokens", s.ints("next", {drafts[depth - 2]}, dims({1, 1}))},
                                   {"past_len", s.ints("past", {past_len - 1 + depth - 1}, dims({1}))}}));
            mtp->enqueue(stream);
            drafts[depth - 1] = fetch(mtp->output("draft_tokens"), 1)[0];
            check(cudaMemcpyAsync(h.ptr, mtp->output("hidden_out"), row_bytes, cudaMemcpyDeviceToDevice, stream),
                  "copy hidden");
        }
    }
    const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // ---- fused steps: inputs from pinned host memory, outputs back to it (all capturable) -----------
    struct HostIo {
        int32_t ids[64], past_len, thinking;                         // in
        int32_t accepted[64], num_accepted, thinking_out, drafts[64];  // out
    };
    if (K + 1 > 64) throw std::runtime_error("this sample supports nextn <= 63");
    HostIo* io = nullptr;
    check(cudaMallocHost(reinterpret_cast<void**>(&io), sizeof(HostIo)), "cudaMallocHost");
    std::map<std::string, Tensor> in = {{"input_ids", s.ints("step_ids", std::vector<int32_t>(K + 1), dims({1, K + 1}))},
                                        {"past_len", s.ints("step_past", {0}, dims({1}))},
                                        {"thinking", s.ints("step_th", {0}, dims({1}))},
                                        {"relaxed_topk", s.ints("step_topk", {opt.relaxed_topk}, dims({}))},
                                        {"relaxed_delta", s.f32("step_delta", opt.relaxed_delta)}};
    step->bind(with_caches(in));
    auto issue = [&]() {  // one step's work on the stream: H2D inputs, the engine, D2H outputs
        check(cudaMemcpyAsync(in["input_ids"].ptr, io->ids, (K + 1) * 4, cudaMemcpyHostToDevice, stream), "h2d");
        check(cudaMemcpyAsync(in["past_len"].ptr, &io->past_len, 4, cudaMemcpyHostToDevice, stream), "h2d");
        check(cudaMemcpyAsync(in["thinking"].ptr, &io->thinking, 4, cudaMemcpyHostToDevice, stream), "h2d");
        step->enqueue(stream);
        check(cudaMemcpyAsync(io->accepted, step->output("accepted_tokens"), (K + 1) * 4, cudaMemcpyDeviceToHost, stream), "d2h");
        check(cudaMemcpyAsync(&io->num_accepted, step->output("num_accepted"), 4, cudaMemcpyDeviceToHost, stream), "d2h");
        check(cudaMemcpyAsync(&io->thinking_out, step->output("thinking_out"), 4, cudaMemcpyDeviceToHost, stream), "d2h");
        if (K) check(cudaMemcpyAsync(io->drafts, step->output("drafts"), K * 4, cudaMemcpyDeviceToHost, stream), "d2h");
    };
    cudaGraphExec_t exec = nullptr;
    long steps = 0, accepted_total = 0;
    bool done = std::find(eos.begin(), eos.end(), first) != eos.end() || opt.max_new_tokens <= 1;
    const auto t1 = std::chrono::steady_clock::now();
    while (!done && past_len + 2 * K + 2 <= rows) {
        io->ids[0] = last;
        std::copy(drafts.begin(), drafts.end(), io->ids + 1);
        io->past_len = past_len;
        io->thinking = thinking;
        if (exec) {
            check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
        } else if (opt.cuda_graph && steps > 0) {  // capture after one plain run (TensorRT's set-up is done)
            cudaGraph_t graph;
            check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
            issue();
            check(cudaStreamEndCapture(stream, &graph), "capture");
            check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
            check(cudaGraphDestroy(graph), "cudaGraphDestroy");
            check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
        } else {
            issue();
        }
        check(cudaStreamSynchronize(stream), "step");
        const int n = io->num_accepted;
        ++steps;
        accepted_total += n + 1;
        for (int j = 0; j <= n && !done; ++j) {  // emit the accepted drafts and the bonus token
            out_ids.push_back(io->accepted[j]);
            done = std::find(eos.begin(), eos.end(), io->accepted[j]) != eos.end() ||
                   static_cast<int>(out_ids.size()) >= opt.max_new_tokens;
        }
        past_len += n + 1;  // rewinds the rejected rows: the next step overwrites them
        last = io->accepted[n];
        thinking = io->thinking_out;
        std::copy(io->drafts, io->drafts + K, drafts.begin());
    }
    const double decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();

    for (size_t j = 0; j < out_ids.size(); ++j) std::printf("%s%d", j ? " " : "", out_ids[j]);
    std::printf("\n");
    std::fprintf(stderr, "%zu new tokens, prefill %.1f ms, %.1f tokens/s in decode steps, mean accepted tokens %.2f "
                 "(nextn %d, %ld steps%s)\n", out_ids.size(), prefill_s * 1e3,
                 decode_s > 0 ? (out_ids.size() - 1) / decode_s : 0.0,
                 steps ? static_cast<double>(accepted_total) / steps : 0.0, K, steps, exec ? ", CUDA graph" : "");
    if (exec) cudaGraphExecDestroy(exec);
    cudaFreeHost(io);
    cudaStreamDestroy(stream);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(parse_args(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "mtp_trt_runner: %s\n", e.what());
        return 2;
    }
}
