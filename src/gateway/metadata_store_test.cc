#include "gateway/metadata_store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include "store/testing.h"

namespace nbos::gateway {
namespace {

TEST(MetadataStoreTest, KernelsSurviveReopening) {
  store::ScopedTempDir dir;
  const std::string path = (dir.path() / "gateway.db").string();
  {
    auto db = MetadataStore::Open(path);
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    StoredKernel k{"k1",
                   "nbos",
                   "secret",
                   "s1",
                   {{"gpus", 2}},
                   "2026-01-01T00:00:00.000000Z",
                   {{1, "host-1", "127.0.0.1:4000", "{}"},
                    {2, "host-2", "127.0.0.1:4002", "{}", /*left_group=*/true}}};
    k.env = {{"KERNEL_GPUS", "2"}, {"KERNEL_USERNAME", "ada"}};
    k.checkpoint = "c0ffee";
    k.owner = "alice";
    k.resuming = true;
    k.starting = true;
    k.restarting = true;
    ASSERT_TRUE((*db)->Put(k).ok());
    k.kernel_id = "k2";
    ASSERT_TRUE((*db)->Put(k).ok());
    ASSERT_TRUE((*db)->Remove("k2").ok());
  }
  auto db = MetadataStore::Open(path);
  ASSERT_TRUE(db.ok());
  auto kernels = (*db)->List();
  ASSERT_TRUE(kernels.ok());
  ASSERT_EQ(kernels->size(), 1u);
  const StoredKernel& k = kernels->front();
  EXPECT_EQ(k.kernel_id, "k1");
  EXPECT_EQ(k.key, "secret");
  EXPECT_EQ(k.resources["gpus"], 2);
  ASSERT_EQ(k.replicas.size(), 2u);
  EXPECT_EQ(k.replicas[1].server_id, "host-2");
  EXPECT_EQ(k.replicas[1].raft_address, "127.0.0.1:4002");
  EXPECT_FALSE(k.replicas[0].left_group);
  EXPECT_TRUE(k.replicas[1].left_group);
  EXPECT_EQ(k.env,
            (std::map<std::string, std::string>{{"KERNEL_GPUS", "2"}, {"KERNEL_USERNAME", "ada"}}));
  EXPECT_EQ(k.checkpoint, "c0ffee");
  EXPECT_EQ(k.owner, "alice");
  EXPECT_TRUE(k.resuming);
  EXPECT_TRUE(k.starting);
  EXPECT_TRUE(k.restarting);
}

TEST(MetadataStoreTest, DatabaseWithoutTheNewerColumnsIsUpgraded) {
  store::ScopedTempDir dir;
  const std::string path = (dir.path() / "gateway.db").string();
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db,
                           "CREATE TABLE kernels (id TEXT PRIMARY KEY, kernelspec TEXT, key TEXT, "
                           "session TEXT, resources TEXT, created TEXT, replicas TEXT);"
                           "INSERT INTO kernels VALUES ('old', 'nbos', 'k', 's', '{}', "
                           "'2026-01-01T00:00:00.000000Z', '[]')",
                           nullptr, nullptr, nullptr),
              SQLITE_OK);
    sqlite3_close(db);
  }
  auto db = MetadataStore::Open(path);
  ASSERT_TRUE(db.ok()) << db.status().ToString();
  StoredKernel fresh;
  fresh.kernel_id = "new";
  fresh.created = "2026-01-02T00:00:00.000000Z";
  fresh.env = {{"KERNEL_X", "1"}};
  fresh.owner = "bob";
  fresh.resuming = true;
  fresh.starting = true;
  fresh.restarting = true;
  ASSERT_TRUE((*db)->Put(fresh).ok());
  auto kernels = (*db)->List();
  ASSERT_TRUE(kernels.ok()) << kernels.status().ToString();
  ASSERT_EQ(kernels->size(), 2u);
  EXPECT_EQ((*kernels)[0].kernel_id, "old");
  EXPECT_TRUE((*kernels)[0].env.empty());
  EXPECT_TRUE((*kernels)[0].checkpoint.empty());
  EXPECT_TRUE((*kernels)[0].owner.empty());
  EXPECT_FALSE((*kernels)[0].resuming);
  EXPECT_FALSE((*kernels)[0].starting);
  EXPECT_FALSE((*kernels)[0].restarting);
  EXPECT_EQ((*kernels)[1].env.at("KERNEL_X"), "1");
  EXPECT_EQ((*kernels)[1].owner, "bob");
  EXPECT_TRUE((*kernels)[1].resuming);
  EXPECT_TRUE((*kernels)[1].starting);
  EXPECT_TRUE((*kernels)[1].restarting);
}

TEST(MetadataStoreTest, UnopenablePathIsAClearError) {
  auto db = MetadataStore::Open("/nonexistent-dir/for/sure/gateway.db");
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace nbos::gateway
