// kernels_driver.cpp -- plugins/ort/kernels.h's kernels on their own, for tests/test_ort_arm64.py: built with
// kernels.cpp for the machine under test (natively, or for aarch64 and run under qemu-user), it reads one call's
// inputs from a file and writes its outputs to another, so the same inputs go through every instruction set.
//
//   kernels_driver paths                      prints "<qpath_name> <index_path_name>"
//   kernels_driver <op> <input> <output>      op: qdot quantize rows_dot rows_axpy attend swiglu index
//
// MTP_TRT_CPU_ISA selects the instruction set (kernels.h cpu_isa); where it cannot be had the driver refuses,
// as the operators' library does: its one line (cpu_isa_error) on stderr, exit status 2.
//
// An input file is 8 int64 parameters, then the op's arrays back to back (their sizes follow from the
// parameters); the output is the op's float32 (or byte) results back to back.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

using namespace mtp_ort;

namespace {

struct Input {
    std::vector<uint8_t> bytes;
    size_t at = 64;
    int64_t p[8];
    explicit Input(const char* path) {
        FILE* f = std::fopen(path, "rb");
        if (!f) throw std::runtime_error(std::string("cannot read ") + path);
        uint8_t buf[1 << 16];
        size_t got;
        while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + got);
        std::fclose(f);
        if (bytes.size() < 64) throw std::runtime_error("input shorter than its parameters");
        std::memcpy(p, bytes.data(), 64);
    }
    template <class T>
    const T* take(size_t n) {  // the next n values of T (a copy that is suitably aligned)
        if (at + n * sizeof(T) > bytes.size()) throw std::runtime_error("input shorter than its arrays");
        auto* out = new T[n ? n : 1];
        std::memcpy(out, bytes.data() + at, n * sizeof(T));
        at += n * sizeof(T);
        return out;
    }
};

void write(const char* path, const void* data, size_t bytes) {
    FILE* f = std::fopen(path, "ab");
    if (!f || std::fwrite(data, 1, bytes, f) != bytes) throw std::runtime_error(std::string("cannot write ") + path);
    std::fclose(f);
}

QWeights weights(Input& in, size_t n, size_t k, int bits, size_t block, bool half) {
    QWeights w{nullptr, nullptr, k, block, bits, half};
    w.data = in.take<uint8_t>(n * w.row_bytes());
    w.scales = half ? static_cast<const void*>(in.take<uint16_t>(n * w.blocks()))
                    : static_cast<const void*>(in.take<float>(n * w.blocks()));
    return w;
}

void run(const std::string& op, Input& in, const char* out) {
    const int64_t* p = in.p;
    std::FILE* f = std::fopen(out, "wb");  // (truncate)
    if (f) std::fclose(f);
    if (op == "qdot" || op == "quantize") {  // bits block half m n k; x [m, k], data, scales
        const int bits = int(p[0]);
        const size_t block = size_t(p[1]), m = size_t(p[3]), n = size_t(p[4]), k = size_t(p[5]);
        const float* x = in.take<float>(m * k);
        const QWeights w = weights(in, n, k, bits, block, p[2] != 0);
        std::vector<uint8_t> qx(m * qrow_bytes(w));
        quantize_rows(x, m, k, w, qx.data());
        if (op == "quantize") return write(out, qx.data(), qx.size());
        // all rows in one call, then each row alone (the same bits expected)
        std::vector<float> y(m * n), one(m * n);
        qrows_dot(qx.data(), m, w, n, y.data(), n);
        for (size_t i = 0; i < m; ++i) qrows_dot(qx.data() + i * qrow_bytes(w), 1, w, n, one.data() + i * n, n);
        write(out, y.data(), 4 * y.size());
        return write(out, one.data(), 4 * one.size());
    }
    if (op == "rows_dot") {  // m n k; x [m, k], w [n, k]
        const size_t m = size_t(p[0]), n = size_t(p[1]), k = size_t(p[2]);
        const float *x = in.take<float>(m * k), *w = in.take<float>(n * k);
        std::vector<float> y(m * n);
        rows_dot(x, m, k, w, k, n, k, y.data(), n);
        return write(out, y.data(), 4 * y.size());
    }
    if (op == "rows_axpy") {  // m n dv; p [m, n], v [n, dv], y [m, dv]
        const size_t m = size_t(p[0]), n = size_t(p[1]), dv = size_t(p[2]);
        const float *pr = in.take<float>(m * n), *v = in.take<float>(n * dv), *y0 = in.take<float>(m * dv);
        std::vector<float> y(y0, y0 + m * dv);
        rows_axpy(pr, m, n, v, dv, n, dv, y.data(), dv);
        return write(out, y.data(), 4 * y.size());
    }
    if (op == "attend") {  // heads c dl n_cache n_rows; scale [1], q [H, C], cache [n_cache, C], rows, visible
        const size_t h = size_t(p[0]), c = size_t(p[1]), dl = size_t(p[2]), nc = size_t(p[3]), nr = size_t(p[4]);
        const float scale = *in.take<float>(1);
        const float *q = in.take<float>(h * c), *cache = in.take<float>(nc * c), *rows = in.take<float>(nr * c);
        const uint8_t* visible = in.take<uint8_t>(nr);
        std::vector<float> scores(h * mla_scores_stride(nc + nr)), o(h * dl);
        mla_attend_token(q, h, c, dl, scale, cache, nc, rows, nr, c, visible, scores.data(), o.data(), dl);
        return write(out, o.data(), 4 * o.size());
    }
    if (op == "swiglu") {  // m units; h [m, 2 units]
        const size_t m = size_t(p[0]), units = size_t(p[1]);
        const float* h = in.take<float>(m * 2 * units);
        std::vector<float> a(m * units);
        swiglu_pairs(h, m, 2 * units, units, a.data(), units);
        return write(out, a.data(), 4 * a.size());
    }
    if (op == "index") {  // heads di n; scale [1], q [heads, di], w [heads], keys [n, di]
        const size_t heads = size_t(p[0]), di = size_t(p[1]), n = size_t(p[2]);
        const float scale = *in.take<float>(1);
        const float *q = in.take<float>(heads * di), *w = in.take<float>(heads), *keys = in.take<float>(n * di);
        std::vector<float> s(n);
        index_scores(q, w, heads, di, scale, keys, di, n, s.data());
        return write(out, s.data(), 4 * s.size());
    }
    throw std::runtime_error("unknown op " + op);
}

}  // namespace

int main(int argc, char** argv) {
    try {
        if (*cpu_isa_error()) throw std::runtime_error(cpu_isa_error());
        if (argc == 2 && std::string(argv[1]) == "paths") {
            std::printf("%s %s\n", qpath_name(), index_path_name());
            return 0;
        }
        if (argc != 4) throw std::runtime_error("usage: kernels_driver paths | <op> <input> <output>");
        Input in(argv[2]);
        run(argv[1], in, argv[3]);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kernels_driver: %s\n", e.what());
        return 2;
    }
}
