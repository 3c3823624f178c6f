// json_probe.cpp -- reads a JSON file with samples/cpp/json.h and prints what the runner takes from
// engines.json / export_manifest.json, for tests/test_cpp_json.py to compare with Python's json.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "json.h"

namespace {
void dump(const json::Value& v) {
    switch (v.kind) {
        case json::Value::Kind::kNull: std::printf("null"); break;
        case json::Value::Kind::kBool: std::printf(v.b ? "true" : "false"); break;
        case json::Value::Kind::kNumber: std::printf("%.17g", v.num); break;
        case json::Value::Kind::kString: {
            std::printf("\"");
            for (char c : v.str) {
                if (c == '"' || c == '\\') std::printf("\\%c", c);
                else if (static_cast<unsigned char>(c) < 0x20) std::printf("\\u%04x", c);
                else std::printf("%c", c);
            }
            std::printf("\"");
            break;
        }
        case json::Value::Kind::kArray: {
            std::printf("[");
            for (size_t i = 0; i < v.arr.size(); ++i) {
                if (i) std::printf(", ");
                dump(v.arr[i]);
            }
            std::printf("]");
            break;
        }
        case json::Value::Kind::kObject: {
            std::printf("{");
            bool first = true;
            for (const auto& [k, x] : v.obj) {
                std::printf(first ? "\"%s\": " : ", \"%s\": ", k.c_str());
                dump(x);
                first = false;
            }
            std::printf("}");
            break;
        }
    }
}
}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    std::ifstream f(argv[1]);
    std::stringstream ss;
    ss << f.rdbuf();
    try {
        dump(json::parse(ss.str()));
        std::printf("\n");
    } catch (const std::exception& e) {
        std::printf("error: %s\n", e.what());
        return 1;
    }
    return 0;
}
