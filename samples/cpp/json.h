// json.h -- a minimal JSON reader for the C++ runner: enough for engines.json and
// export_manifest.json (objects, arrays, strings with simple escapes, numbers, true/false/null).
// Not a general-purpose parser: no \u escapes beyond ASCII, numbers read as double.
#ifndef MTP_TRT_SAMPLE_JSON_H
#define MTP_TRT_SAMPLE_JSON_H

#include <cctype>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace json {

struct Value {
    enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = Kind::kNull;
    bool b = false;
    double num = 0.0;
    std::string str;
    std::vector<Value> arr;
    std::map<std::string, Value> obj;

    const Value& operator[](const std::string& key) const {
        auto it = obj.find(key);
        if (kind != Kind::kObject || it == obj.end()) throw std::runtime_error("JSON: missing key '" + key + "'");
        return it->second;
    }
    bool has(const std::string& key) const { return kind == Kind::kObject && obj.count(key) != 0; }
    int as_int() const {
        if (kind != Kind::kNumber) throw std::runtime_error("JSON: expected a number");
        return static_cast<int>(num);
    }
    const std::string& as_string() const {
        if (kind != Kind::kString) throw std::runtime_error("JSON: expected a string");
        return str;
    }
};

class Parser {
   public:
    explicit Parser(const std::string& text) : s_(text) {}

    Value parse() {
        Value v = value();
        skip();
        if (i_ != s_.size()) fail("trailing characters");
        return v;
    }

   private:
    [[noreturn]] void fail(const std::string& what) const {
        throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
    }
    void skip() {
        while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    bool eat(char c) {
        skip();
        if (i_ < s_.size() && s_[i_] == c) {
            ++i_;
            return true;
        }
        return false;
    }
    void expect(char c) {
        if (!eat(c)) fail(std::string("expected '") + c + "'");
    }
    bool word(const char* w) {
        const std::string ws(w);
        if (s_.compare(i_, ws.size(), ws) != 0) return false;
        i_ += ws.size();
        return true;
    }

    std::string string() {
        expect('"');
        std::string out;
        while (i_ < s_.size() && s_[i_] != '"') {
            char c = s_[i_++];
            if (c == '\\' && i_ < s_.size()) {
                const char e = s_[i_++];
                c = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'b' ? '\b' : e == 'f' ? '\f' : e;
                if (e == 'u') {  // \uXXXX: ASCII only, others become '?'
                    const long code = std::strtol(s_.substr(i_, 4).c_str(), nullptr, 16);
                    c = code < 128 ? static_cast<char>(code) : '?';
                    i_ += 4;
                }
            }
            out += c;
        }
        expect('"');
        return out;
    }

    Value value() {
        skip();
        Value v;
        if (i_ >= s_.size()) fail("unexpected end");
        const char c = s_[i_];
        if (c == '{') {
            v.kind = Value::Kind::kObject;
            ++i_;
            if (eat('}')) return v;
            do {
                skip();
                std::string key = string();
                expect(':');
                v.obj[key] = value();
            } while (eat(','));
            expect('}');
        } else if (c == '[') {
            v.kind = Value::Kind::kArray;
            ++i_;
            if (eat(']')) return v;
            do v.arr.push_back(value());
            while (eat(','));
            expect(']');
        } else if (c == '"') {
            v.kind = Value::Kind::kString;
            v.str = string();
        } else if (word("true")) {
            v.kind = Value::Kind::kBool;
            v.b = true;
        } else if (word("false")) {
            v.kind = Value::Kind::kBool;
        } else if (word("null")) {
            v.kind = Value::Kind::kNull;
        } else {
            char* end = nullptr;
            v.kind = Value::Kind::kNumber;
            v.num = std::strtod(s_.c_str() + i_, &end);
            if (end == s_.c_str() + i_) fail("bad value");
            i_ = static_cast<size_t>(end - s_.c_str());
        }
        return v;
    }

    const std::string& s_;
    size_t i_ = 0;
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace json

#endif  // MTP_TRT_SAMPLE_JSON_H
