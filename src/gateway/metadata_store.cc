#include "gateway/metadata_store.h"

#include <sqlite3.h>

#include <mutex>

namespace nbos::gateway {
namespace {

using jupyter::Json;

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}

// Closes a prepared statement on every path out of a function.
struct Statement {
  sqlite3_stmt* stmt = nullptr;
  ~Statement() { sqlite3_finalize(stmt); }
};

Json ReplicasToJson(const std::vector<StoredReplica>& replicas) {
  Json out = Json::array();
  for (const auto& r : replicas) {
    Json replica{{"replica_id", r.replica_id},
                 {"server_id", r.server_id},
                 {"raft_address", r.raft_address},
                 {"connection", r.connection_json}};
    if (r.left_group) replica["left_group"] = true;
    out.push_back(std::move(replica));
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<MetadataStore>> MetadataStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) {
    std::string message = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Unavailable("opening the gateway database " + path + ": " + message);
  }
  std::unique_ptr<MetadataStore> store(new MetadataStore(db));
  // Another process may hold the database briefly (an operator's sqlite3, a backup): a write
  // waits that long before it fails.
  sqlite3_busy_timeout(db, 2000);
  for (const char* sql :
       {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
        "CREATE TABLE IF NOT EXISTS kernels (id TEXT PRIMARY KEY, "
        "kernelspec TEXT, key TEXT, session TEXT, resources TEXT, "
        "created TEXT, replicas TEXT, env TEXT, checkpoint TEXT, owner TEXT, resuming TEXT, "
        "starting TEXT, restarting TEXT)"}) {
    if (Status s = store->Exec(sql); !s.ok()) return s;
  }
  // Databases written before a column existed gain it; their kernels read as not having it.
  for (const char* column : {"env", "checkpoint", "owner", "resuming", "starting", "restarting"}) {
    Statement probe;
    const std::string select = std::string("SELECT ") + column + " FROM kernels LIMIT 0";
    if (sqlite3_prepare_v2(db, select.c_str(), -1, &probe.stmt, nullptr) != SQLITE_OK) {
      const std::string alter = std::string("ALTER TABLE kernels ADD COLUMN ") + column + " TEXT";
      if (Status s = store->Exec(alter.c_str()); !s.ok()) return s;
    }
  }
  return store;
}

MetadataStore::MetadataStore(sqlite3* db) : db_(db) {}
MetadataStore::~MetadataStore() { sqlite3_close(db_); }

Status MetadataStore::Exec(const char* sql) {
  char* error = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &error) != SQLITE_OK) {
    std::string message = error ? error : "unknown error";
    sqlite3_free(error);
    return Unavailable(std::string("gateway database: ") + message);
  }
  return Status::Ok();
}

Status MetadataStore::Put(const StoredKernel& k) {
  std::lock_guard lock(Mu());
  Statement st;
  if (sqlite3_prepare_v2(
          db_,
          "INSERT OR REPLACE INTO kernels (id, kernelspec, key, session, resources, "
          "created, replicas, env, checkpoint, owner, resuming, starting, restarting) "
          "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
          -1, &st.stmt, nullptr) != SQLITE_OK) {
    return Unavailable(std::string("gateway database: ") + sqlite3_errmsg(db_));
  }
  const std::string resources = k.resources.dump();
  const std::string replicas = ReplicasToJson(k.replicas).dump();
  const std::string env = Json(k.env).dump();
  const std::string resuming = k.resuming ? "1" : "";
  const std::string starting = k.starting ? "1" : "";
  const std::string restarting = k.restarting ? "1" : "";
  const std::string* values[] = {&k.kernel_id, &k.kernelspec, &k.key,     &k.session_id, &resources,
                                 &k.created,   &replicas,     &env,       &k.checkpoint, &k.owner,
                                 &resuming,    &starting,     &restarting};
  for (int i = 0; i < 13; ++i) {
    sqlite3_bind_text(st.stmt, i + 1, values[i]->c_str(), static_cast<int>(values[i]->size()),
                      SQLITE_TRANSIENT);
  }
  if (sqlite3_step(st.stmt) != SQLITE_DONE) {
    return Unavailable(std::string("gateway database: ") + sqlite3_errmsg(db_));
  }
  return Status::Ok();
}

Status MetadataStore::Remove(const std::string& kernel_id) {
  std::lock_guard lock(Mu());
  Statement st;
  if (sqlite3_prepare_v2(db_, "DELETE FROM kernels WHERE id = ?", -1, &st.stmt, nullptr) !=
      SQLITE_OK) {
    return Unavailable(std::string("gateway database: ") + sqlite3_errmsg(db_));
  }
  sqlite3_bind_text(st.stmt, 1, kernel_id.c_str(), static_cast<int>(kernel_id.size()),
                    SQLITE_TRANSIENT);
  if (sqlite3_step(st.stmt) != SQLITE_DONE) {
    return Unavailable(std::string("gateway database: ") + sqlite3_errmsg(db_));
  }
  return Status::Ok();
}

Result<std::vector<StoredKernel>> MetadataStore::List() {
  std::lock_guard lock(Mu());
  Statement st;
  if (sqlite3_prepare_v2(db_,
                         "SELECT id, kernelspec, key, session, resources, created, replicas, env, "
                         "checkpoint, owner, resuming, starting, restarting "
                         "FROM kernels ORDER BY created",
                         -1, &st.stmt, nullptr) != SQLITE_OK) {
    return Unavailable(std::string("gateway database: ") + sqlite3_errmsg(db_));
  }
  std::vector<StoredKernel> out;
  int rc;
  while ((rc = sqlite3_step(st.stmt)) == SQLITE_ROW) {
    auto text = [&](int i) {
      const unsigned char* t = sqlite3_column_text(st.stmt, i);
      return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
    };
    StoredKernel k;
    k.kernel_id = text(0);
    k.kernelspec = text(1);
    k.key = text(2);
    k.session_id = text(3);
    k.resources = Json::parse(text(4), nullptr, false);
    if (!k.resources.is_object()) k.resources = Json::object();
    k.created = text(5);
    Json replicas = Json::parse(text(6), nullptr, false);
    if (replicas.is_array()) {
      for (const Json& r : replicas) {
        k.replicas.push_back({r.value("replica_id", 0u), r.value("server_id", ""),
                              r.value("raft_address", ""), r.value("connection", ""),
                              r.value("left_group", false)});
      }
    }
    Json env = Json::parse(text(7), nullptr, false);
    if (env.is_object()) {
      for (const auto& [name, value] : env.items()) {
        if (value.is_string()) k.env[name] = value.get<std::string>();
      }
    }
    k.checkpoint = text(8);
    k.owner = text(9);
    k.resuming = text(10) == "1";
    k.starting = text(11) == "1";
    k.restarting = text(12) == "1";
    out.push_back(std::move(k));
  }
  if (rc != SQLITE_DONE)
    return Unavailable(std::string("gateway database: ") + sqlite3_errmsg(db_));
  return out;
}

}  // namespace nbos::gateway
